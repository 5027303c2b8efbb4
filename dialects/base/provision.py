"""Test provisioning: where the contract, property, fault and chaos suites find a server.

Each family registers a :class:`Provision` as ``PROVISION`` in its
``provision`` module (see :mod:`~outbox_core.dialects.base.companions`),
as SQLAlchemy's backends register theirs in ``provision.py``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from outbox_core.dialects.base.companions import companion
from outbox_core.dialects.base.registry import get_dialect


@dataclass(frozen=True)
class Provision:
    """Where one family's test server is, and whether CI must have it."""

    #: The registry name (``OUTBOX_TEST_<NAME>_URL`` names its server).
    name: str
    #: Where the suites find a server when the variable is unset (None: only where it is set).
    default_url: str | None = None
    #: With ``CI=true`` an unreachable test server fails the suites instead of skipping them.
    required_in_ci: bool = False
    #: The test database is a server to reach (SQLite's is a file).
    needs_server: bool = True

    def test_url(self, workdir: Path) -> str | None:
        """The database the suites run on: ``OUTBOX_TEST_<NAME>_URL``, else the default.

        A family without a server (SQLite) overrides this with a fresh file in ``workdir``.
        """
        return os.environ.get(f"OUTBOX_TEST_{self.name.upper()}_URL") or self.default_url


def provision_for(name: str) -> Provision:
    """The provisioning of the family registered as ``name`` (defaults where it has none)."""
    dialect = get_dialect(name)
    module = companion(dialect, "provision")
    found = getattr(module, "PROVISION", None)
    return found if isinstance(found, Provision) else Provision(dialect.name)
