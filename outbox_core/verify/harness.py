"""What a check runs on: a fresh outbox on its own temporary table, its connections, its threads.

Each check gets a :class:`Context` over an ``outbox_verify_<random>`` table
(:func:`temporary_outbox` creates the name and drops the tables after); the
real outbox table is never read or written.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, wait
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import sqlalchemy as sa

from outbox_core.dialects.base import Dialect, SessionLimits
from outbox_core.errors import UnsupportedDatabase
from outbox_core.message import Event
from outbox_core.outbox import Outbox
from outbox_core.verify.model import Failed, Skip

T = TypeVar("T")

#: How long a check's threads may run before the check fails as hung.
HANG_SECONDS = 120.0


def temporary_table() -> str:
    """A fresh name for a check's outbox table."""
    return f"outbox_verify_{uuid.uuid4().hex[:10]}"


@contextmanager
def temporary_outbox(make: Callable[[str, str], Outbox], url: str) -> Iterator[Outbox]:
    """An outbox (not yet installed) on a temporary table; its tables dropped after."""
    outbox = make(url, temporary_table())
    try:
        yield outbox
    finally:
        try:
            outbox.tables.metadata.drop_all(outbox.engine)
        finally:
            outbox.dispose()


@dataclass
class Context:
    """What a check gets: a fresh, installed outbox on its own temporary table."""

    outbox: Outbox
    #: ``quick``, ``default`` or ``thorough``: how much concurrent work the checks do.
    mode: str = "default"

    def size(self, quick: int, default: int, thorough: int) -> int:
        """The amount of work for this run's mode."""
        return {"quick": quick, "thorough": thorough}.get(self.mode, default)

    @property
    def dialect(self) -> Dialect:
        """The outbox's dialect (the strategy under test)."""
        return self.outbox.dialect

    @contextmanager
    def connection(self) -> Iterator[sa.Connection]:
        """A connection configured as a relay's (session limits from a 30 s lease)."""
        conn = self.outbox.engine.connect()
        try:
            self.dialect.session.configure(conn, SessionLimits.for_lease(30.0))
            yield conn
        finally:
            conn.close()

    def enqueue(self, *events: tuple[str | None, Any]) -> list[str]:
        """Commit ``(key, payload)`` events in one transaction; their event ids."""
        with self.outbox.engine.begin() as conn:
            return self.outbox.enqueue_many(
                conn, [{"topic": "verify", "payload": p, "key": k} for k, p in events]
            )

    def claim(
        self, conn: sa.Connection, token: str, *, limit: int = 100, ordered: bool = False
    ) -> list[Event]:
        """One claim on ``conn`` (a 30 s lease)."""
        return self.dialect.claim(conn, limit=limit, lease=30.0, token=token, ordered=ordered)


class RollBack(Exception):
    """Raised inside ``engine.begin()`` to roll the transaction back on purpose."""


def expect(condition: bool, message: str) -> None:
    """Fail the guarantee with ``message`` unless ``condition``."""
    if not condition:
        raise Failed(message)


def needs_ordered_claims(ctx: Context) -> None:
    """Skip, with the reason, where ordered relays refuse to start (SQL Server without RCSI)."""
    with ctx.outbox.engine.connect() as conn:
        try:
            ctx.dialect.check_ordered(conn)
        except UnsupportedDatabase as exc:
            raise Skip(str(exc)) from None


def run_concurrently(target: Callable[[int], T], n: int) -> list[T]:
    """``target(0)`` ... ``target(n - 1)`` on threads at once; their results in slot order.

    Waits for every thread, then re-raises the first slot's error (through
    its future). Threads still running after :data:`HANG_SECONDS` fail the
    check; they are daemons, so a hung connection cannot keep the process
    alive (a thread pool would join them at exit).
    """
    futures = [_on_daemon_thread(target, slot) for slot in range(n)]
    _done, running = wait(futures, timeout=HANG_SECONDS)
    if running:
        raise Failed("a check's connection hung for two minutes")
    return [future.result() for future in futures]


def _on_daemon_thread(target: Callable[[int], T], slot: int) -> Future[T]:
    future: Future[T] = Future()

    def run() -> None:
        future.set_running_or_notify_cancel()
        try:
            future.set_result(target(slot))
        except BaseException as exc:  # handed to whoever calls result()
            future.set_exception(exc)

    threading.Thread(target=run, daemon=True, name=f"outbox-verify-{slot}").start()
    return future
