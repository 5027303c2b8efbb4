"""The test suites' SQLite database: a fresh file per test, no server."""

from __future__ import annotations

from pathlib import Path

from outbox_core.dialects.base.provision import Provision


class SqliteProvision(Provision):
    """A file in the test's own directory."""

    def test_url(self, workdir: Path) -> str | None:
        """A fresh database file per test: no server needed."""
        return f"sqlite:///{workdir / 'outbox.sqlite3'}"


PROVISION = SqliteProvision("sqlite", needs_server=False)
