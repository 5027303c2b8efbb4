"""Wake this process's relays once a DB-API transaction is over.

DB-API has no commit hook, and the toolkit never wraps the caller's
connection. What most drivers do keep is the transaction state the server
reports with each reply (libpq's transaction status, MySQL's
``SERVER_STATUS_IN_TRANS``, SQLite's autocommit flag, asyncpg's
``is_in_transaction()``). One daemon thread reads that flag for the
connections that enqueued, every few milliseconds while any is waiting, and
runs the callback once it shows no transaction open.

- Waking before the commit would be wrong (the event is not visible yet);
  this wakes after it, a few milliseconds late at most.
- It cannot tell a commit from a rollback: after a rollback the relay is
  woken for nothing and finds nothing, one claim that costs a poll.
- A caller that commits and begins its next transaction between two reads
  keeps the flag set: the wake-up then comes when that next transaction
  ends, and the relay's own polling (``poll_interval``) still finds the
  event in between. Nothing is lost, only the early wake-up.
- A transaction still open after :data:`GIVE_UP` seconds is no longer
  watched (nor its connection kept alive): its events are found by the
  relays' polling, which by then costs no more than the wake-up saves.
- Drivers without such a flag (mysqlclient, pyodbc) get no wake-up from
  here: in-process relays find their events by polling.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

#: Seconds between two reads of the flags while a transaction is waited for.
INTERVAL = 0.005
#: Seconds after which a transaction still open is no longer watched.
GIVE_UP = 60.0

_Entry = tuple[Any, Callable[[Any], bool], Callable[[], None], float]


class CommitWatch:
    """Callbacks waiting for their connection's transaction to end (one thread for all)."""

    def __init__(self, interval: float = INTERVAL, give_up: float = GIVE_UP) -> None:
        self.interval = interval
        self.give_up = give_up
        self._reset()
        # A child forked while the watch thread held the lock (gunicorn's preload,
        # Celery's prefork) would wait on it forever; its parent's connections
        # and thread are not its own either.
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._cond = threading.Condition()
        # (id(connection), id(owner)) -> (connection, ended, callback, deadline).
        # The latest callback replaces an earlier one: each wakes the same relays.
        self._pending: dict[tuple[int, int], _Entry] = {}
        self._thread: threading.Thread | None = None

    def watch(
        self,
        conn: Any,
        ended: Callable[[Any], bool],
        callback: Callable[[], None],
        *,
        owner: object = None,
    ) -> None:
        """Call ``callback`` once ``ended(conn)`` is true (from the watch thread)."""
        with self._cond:
            deadline = time.monotonic() + self.give_up
            self._pending[id(conn), id(owner)] = (conn, ended, callback, deadline)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="outbox-commit-watch", daemon=True
                )
                self._thread.start()
            self._cond.notify()

    def pending(self) -> int:
        """How many callbacks are waiting."""
        with self._cond:
            return len(self._pending)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending:
                    self._cond.wait()
                waiting = list(self._pending.items())
            now = time.monotonic()
            due: list[tuple[tuple[int, int], Callable[[], None]]] = []
            dropped: list[tuple[tuple[int, int], Callable[[], None]]] = []
            for key, (conn, ended, callback, deadline) in waiting:
                if _over(conn, ended):
                    due.append((key, callback))
                elif now > deadline:
                    dropped.append((key, callback))
            if due or dropped:
                with self._cond:
                    for key, callback in due + dropped:
                        # A newer callback for the same connection came meanwhile:
                        # it belongs to a later transaction, keep it.
                        entry = self._pending.get(key)
                        if entry is not None and entry[2] is callback:
                            del self._pending[key]
                for _, callback in due:
                    _call(callback)
            time.sleep(self.interval)


def _over(conn: Any, ended: Callable[[Any], bool]) -> bool:
    try:
        return ended(conn)
    except Exception:
        # A closed connection raises on some drivers: nothing is left to wait for.
        return True


def _call(callback: Callable[[], None]) -> None:
    try:
        callback()
    except Exception:
        log.exception("waking relays after a commit failed")


#: The process's one watch.
COMMIT_WATCH = CommitWatch()
