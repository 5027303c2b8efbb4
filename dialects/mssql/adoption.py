"""Adopting a team's table on SQL Server: an ``IDENTITY`` column, UTC defaults."""

from __future__ import annotations

from typing import ClassVar

from outbox_core.dialects.base.adoption import Adoption


class MssqlAdoption(Adoption):
    """Transactional DDL: the whole adoption commits or rolls back as one."""

    #: ``DATETIME2`` holds UTC: ``GETDATE()`` would be the server's local time.
    now_default: ClassVar[str | None] = "SYSUTCDATETIME()"
    id_definition: ClassVar[str | None] = "BIGINT IDENTITY(1,1) NOT NULL"
