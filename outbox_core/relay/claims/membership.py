"""An ordered relay's membership: join, heartbeat, rebalance, leave.

Each relay that claims in partitioned ordered mode has a row in the
membership table. It writes its heartbeat every ``heartbeat`` seconds; a row
whose heartbeat is older than ``stale_after`` (on the database's clock) is
stale. Whenever the live relays' shares differ from the deterministic split
of the partitions over them (:func:`outbox_core.partitions.split`), or a row
is stale, any relay rebalances: in one transaction it locks every row (which
waits for claims in flight, see :mod:`outbox_core.dialects.base.partitioned`),
deletes the stale rows and writes each live relay's share under a new epoch.
A relay reads its share inside each claim, so the change is fenced: no claim
runs on a share the database no longer holds.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Sequence

from sqlalchemy.engine import Connection

from outbox_core.dialects.base import Dialect
from outbox_core.dialects.base.partitioned import Member
from outbox_core.errors import DatabaseError
from outbox_core.partitions import describe, split
from outbox_core.relay.connections import Connections

log = logging.getLogger("outbox.relay")


class Membership:
    """This relay's row in the membership table, kept alive and in balance."""

    def __init__(
        self,
        relay_id: str,
        dialect: Dialect,
        connections: Connections,
        *,
        heartbeat: float,
        stale_after: float,
    ) -> None:
        self.relay_id = relay_id
        self.dialect = dialect
        self.statements = dialect.partitions
        self.connections = connections
        self.heartbeat = heartbeat
        self.stale_after = stale_after
        #: Rebalances this relay wrote.
        self.rebalances = 0
        #: Times the share this relay's claims read changed (a metric).
        self.share_changes = 0
        #: The share this relay's last claim read (``describe`` form) and its epoch.
        self.share = ""
        self.epoch = 0
        self.joined = False
        self.leaving = False
        self._lock = threading.Lock()
        # Claims in two lanes observe their share at once.
        self._observed = threading.Lock()
        self._next_beat = 0.0

    @property
    def host(self) -> str:
        """Where this relay runs, for ``outbox status``: host and process id."""
        return f"{socket.gethostname()} pid {os.getpid()}"

    def join(self) -> None:
        """Register (replacing a row of the same id) and rebalance at once; not once leaving."""
        if self.leaving:
            return
        self.connections.call("join", self.statements.join, self.relay_id, self.host)
        self.joined = True
        self._next_beat = time.monotonic() + self.heartbeat
        log.info("relay %s joined the ordered relays", self.relay_id)
        self.rebalance()

    def tick(self) -> None:
        """Heartbeat when due; rejoin when found stale; rebalance when the split is off."""
        with self._lock:
            if self.leaving:
                return
            now = time.monotonic()
            if self.joined and now < self._next_beat:
                return
            self._next_beat = now + self.heartbeat
            if not self.joined:
                self.join()
                return
            alive = self.connections.call("heartbeat", self.statements.heartbeat, self.relay_id)
            if not alive:
                log.warning(
                    "relay %s was removed from the ordered relays (its heartbeat was "
                    "older than %.0fs); joining again",
                    self.relay_id,
                    self.stale_after,
                )
                self.join()
                return
            members = self.connections.call("members", self.statements.members)
            if self.unbalanced(members):
                self.rebalance()

    def unbalanced(self, members: Sequence[Member]) -> bool:
        """A stale row, or a live relay whose share is not its part of the split."""
        gone, live, wanted = self._plan(members, leaving=False)
        return bool(gone) or any(m.partitions != wanted[m.relay_id] for m in live)

    def _plan(
        self, members: Sequence[Member], *, leaving: bool
    ) -> tuple[list[str], list[Member], dict[str, str]]:
        """The rows to remove (stale, or this one when ``leaving``), the live rows, and each
        live relay's part of the split (``describe`` form)."""
        gone = [
            m.relay_id
            for m in members
            if (leaving and m.relay_id == self.relay_id)
            or (m.age > self.stale_after and m.relay_id != self.relay_id)
        ]
        live = [m for m in members if m.relay_id not in gone]
        wanted = {k: describe(v) for k, v in split(m.relay_id for m in live).items()}
        return gone, live, wanted

    def rebalance(self, *, leaving: bool = False) -> None:
        """Lock every row, drop stale ones (and this one when ``leaving``), write the split."""
        changed = self.connections.call("rebalance", self._rebalance, leaving)
        if changed:
            self.rebalances += 1

    def _rebalance(self, conn: Connection, leaving: bool) -> bool:
        with self.dialect.transaction(conn):
            members = self.statements.lock_members(conn)
            gone, live, wanted = self._plan(members, leaving=leaving)
            if not gone and all(m.partitions == wanted[m.relay_id] for m in live):
                return False
            # Never below what this relay saw: the number goes on rising while
            # any relay that saw it lives, even when every row was removed.
            epoch = max([self.epoch, *(m.epoch for m in members)]) + 1
            self.statements.remove(conn, gone)
            for m in live:
                self.statements.assign(conn, m.relay_id, wanted[m.relay_id], epoch)
        log.info(
            "relay %s rebalanced the ordered relays (epoch %d): %s%s",
            self.relay_id,
            epoch,
            ", ".join(f"{m.relay_id} {wanted[m.relay_id]}" for m in live) or "none left",
            f"; removed {', '.join(gone)}" if gone else "",
        )
        return True

    def observe(self, share: str, epoch: int) -> None:
        """A claim read this share: note a change (a claim's share is the one that counts)."""
        with self._observed:
            if share != self.share:
                self.share_changes += 1
                log.info(
                    "relay %s now owns partitions %s (epoch %d)",
                    self.relay_id,
                    share or "-",
                    epoch,
                )
            self.share, self.epoch = share, epoch

    def leave(self) -> None:
        """Hand this relay's partitions to the others now (graceful shutdown)."""
        # Under the tick's lock: a heartbeat in progress must not find the row
        # gone and join again after this.
        with self._lock:
            if not self.joined or self.leaving:
                self.leaving = True
                return
            self.leaving = True
            try:
                self.rebalance(leaving=True)
            except DatabaseError as exc:
                # Typically the database is down as the relay stops: one line, no traceback.
                log.warning(
                    "relay %s could not leave the ordered relays (%s); the others take its "
                    "partitions over once its heartbeat is stale",
                    self.relay_id,
                    exc,
                )
            except Exception:
                log.exception("relay %s could not leave the ordered relays", self.relay_id)
            self.joined = False
