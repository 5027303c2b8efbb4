"""MySQL's and MariaDB's partitioned claims: keys compared as their default collations do."""

from __future__ import annotations

from typing import ClassVar

from outbox_core.dialects.base.partitioned import PartitionStatements


class MysqlPartitions(PartitionStatements):
    """``utf8mb4_general_ci`` / ``utf8mb4_0900_ai_ci``: ``GROUP BY key`` folds case and accents."""

    keys_fold: ClassVar[bool] = True
