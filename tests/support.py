"""Helpers shared by the contract, property and chaos suites.

Lock waits are bounded the way relays bound them: with the dialect's own
:meth:`~outbox_core.dialects.base.SessionSetup.configure`, so the tests hold no
database's SET statements of their own.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

import sqlalchemy as sa

from outbox_core.dialects.base import SessionLimits, get_dialect
from outbox_core.schema import OutboxTables

T = TypeVar("T")


def retry(action: Callable[[], T], error: type[Exception], within: float = 30.0) -> T:
    """``action()`` until it stops raising ``error`` (re-raised after ``within`` s): a
    walsender, for one, takes a moment to exit and free its slot."""
    deadline = time.monotonic() + within
    while True:
        try:
            return action()
        except error:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def outbox_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``outbox ARGS`` as a process, the way the README and docs/ci.md show it."""
    return subprocess.run(
        [sys.executable, "-m", "outbox_core.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=os.environ.copy(),
    )


def _limits(seconds: int) -> SessionLimits:
    # A long idle-in-transaction limit: tests hold transactions open on purpose.
    return SessionLimits(idle_in_transaction=3600, lock_wait=seconds)


def set_lock_timeout(conn: sa.Connection, backend: str, seconds: int) -> None:
    """Bound lock waits on one connection, so a claim that waited fails loudly."""
    get_dialect(backend)(OutboxTables.create()).session.configure(conn, _limits(seconds))


def bound_lock_waits(engine: sa.Engine, backend: str, seconds: int) -> None:
    """Bound lock waits on every connection ``engine`` hands out."""
    dialect = get_dialect(backend)(OutboxTables.create())

    @sa.event.listens_for(engine, "engine_connect")
    def _on_connect(conn: sa.Connection) -> None:
        info = conn.connection.info  # the driver connection's: once per connection, not checkout
        if not info.get("outbox_test_lock_wait"):
            dialect.session.configure(conn, _limits(seconds))
            info["outbox_test_lock_wait"] = True


class NoHandoverWait:
    """A broken partitioned claim: a gained partition's keys in flight elsewhere are not seen.

    Wraps a relay's ``owned.statements``; the partition suites show that
    their checks catch it.
    """

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def leased_keys(self, conn: Any, partitions: Any, **kwargs: Any) -> list[tuple[int, str]]:
        return []

    def claim_window(self, *args: Any, **kwargs: Any) -> Any:
        # PostgreSQL's one-statement claim reads the leased rows in SQL.
        return self._inner.claim_window(*args, **{**kwargs, "blocked_by_leases": False})
