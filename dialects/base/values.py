"""Values and constants the dialects share: server identity, table summaries, the
dashboard's reads, session limits."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol, TypeVar

from outbox_core.message import State

T = TypeVar("T")


def aware(value: datetime) -> datetime:
    """A database time as an aware UTC datetime: MySQL's and SQLite's come back naive,
    holding UTC (the toolkit writes UTC there)."""
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


#: Longest error text kept in ``last_error``.
MAX_ERROR = 2000


#: The states of a row still to deliver: pending, or leased by a relay.
ACTIVE_STATES = (State.PENDING, State.LEASED)


#: Most keys one walk of an ordered claim visits (it visits twice the batch,
#: up to this): bounds the walk's work per claim however many keys there are.
MAX_KEYS_PER_CLAIM = 500


#: Run end of a key with fewer pending rows than the run length: no end.
NO_END = 2**62


#: Most walks over keys one ordered claim makes when every key it meets is blocked.
MAX_WALKS = 8


class Listener(Protocol):
    """Waits for wake-ups sent by producers' commits."""

    def wait(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds; True when a wake-up arrived."""

    def received(self, timeout: float) -> list[str]:
        """Block up to ``timeout`` seconds; the channels of the wake-ups that arrived."""

    def close(self) -> None:
        """Stop listening and drop the connection."""


@dataclass(frozen=True)
class ServerInfo:
    """What a server says it is (``outbox doctor``, the compatibility matrix)."""

    #: ``PostgreSQL``, ``MariaDB``, ``MySQL``, ``SQL Server 2022``, ``SQLite``.
    product: str
    #: Its version, e.g. ``15.20`` or ``10.11.19``.
    version: str
    #: The server's own full description (``SELECT version()`` and the like).
    full: str

    @property
    def label(self) -> str:
        """``product version``: a matrix column, a doctor finding."""
        return f"{self.product} {self.version}"


def version_prefix(text: str) -> str:
    """The leading dotted number of a version (``10.11.19-MariaDB-0+deb12u1``: ``10.11.19``)."""
    match = re.match(r"\s*(\d+(?:\.\d+)*)", text)
    return match.group(1) if match else text.strip().split(" ")[0]


@dataclass(frozen=True)
class Activity:
    """The table's recent traffic, from :meth:`Dialect.activity` (times: the database's)."""

    oldest_pending_created: datetime | None
    now: datetime
    created_last_minute: int
    sent_last_minute: int
    last_sent_at: datetime | None


@dataclass(frozen=True)
class Backlog:
    """What waits for a relay, from :meth:`Dialect.backlog`."""

    pending: int
    due: int
    oldest_due: datetime | None
    expired_leases: int
    now: datetime


@dataclass(frozen=True)
class LiveLeases:
    """Leases still running, from :meth:`Dialect.live_leases`."""

    count: int
    until: datetime | None
    tokens: list[str]


@dataclass(frozen=True)
class Overview:
    """The dashboard's summary of the table, from :meth:`ConsoleReads.overview`.

    Times are the database's, as aware UTC datetimes.
    """

    #: The database's clock when the overview was read.
    now: datetime
    pending: int
    leased: int
    dead: int
    #: ``created_at`` of the lowest pending id (None: nothing pending).
    oldest_pending_created: datetime | None
    oldest_pending_id: int | None
    #: The highest id in the table (None: the table is empty).
    newest_id: int | None


@dataclass(frozen=True)
class FlowBucket:
    """Rows created and sent in one span of time, from :meth:`ConsoleReads.flow`."""

    #: The bucket's start (the database's clock, aware UTC).
    start: datetime
    #: Rows whose ``created_at`` is in ``[start, start + bucket)``.
    created: int
    #: Rows whose ``sent_at`` is in ``[start, start + bucket)``.
    sent: int


@dataclass(frozen=True)
class EventRow:
    """One row of the outbox table as the dashboard shows it (times: aware UTC).

    ``payload`` and ``headers`` are None in lists; only
    :meth:`ConsoleReads.event` loads them.
    """

    id: int
    event_id: str
    topic: str
    key: str | None
    state: int
    attempts: int
    created_at: datetime
    available_at: datetime
    sent_at: datetime | None
    lease_until: datetime | None
    key_partition: int | None
    last_error: str | None
    payload: Any | None = None
    headers: dict[str, Any] | None = None


@dataclass(frozen=True)
class HeldKey:
    """A key whose lowest unsent event is dead, holding pending events back."""

    key: str
    #: The dead head's id: the lowest dead id of the key.
    dead_id: int
    dead_error: str | None
    #: Pending events of the key with a higher id (held behind the dead head).
    waiting: int
    #: ``created_at`` of the first of them (aware UTC).
    oldest_waiting_created: datetime | None


@dataclass(frozen=True)
class SessionLimits:
    """Server-side bounds for a relay connection, derived from the relay's lease.

    ``idle_in_transaction``: a transaction left idle this long is rolled back
    by the server (its row locks go with it). ``lock_wait``: the longest a
    statement waits for another session's row lock before failing.
    """

    idle_in_transaction: float
    lock_wait: float

    @classmethod
    def for_lease(cls, lease: float) -> SessionLimits:
        """About one lease for a frozen transaction; a quarter of it (0.5-5 s) for lock waits.

        Relays never wait on each other's locks on purpose (SKIP LOCKED), so
        a lock wait means a stuck session: fail fast and let the lease decide.
        """
        return cls(idle_in_transaction=max(lease, 1.0), lock_wait=min(max(lease / 4, 0.5), 5.0))


def chunked(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    """``items`` in consecutive slices of at most ``size``."""
    for start in range(0, len(items), size):
        yield items[start : start + size]


def delete_in_batches(
    delete_batch: Callable[[int], int], *, batch: int, max_batches: int | None = None
) -> int:
    """Run ``delete_batch(batch)`` (one short transaction each) until little is left.

    Stops when a call deletes fewer than ``batch`` rows or after
    ``max_batches`` calls; returns the rows deleted. Bounded batches keep
    every transaction short (no lock escalation, no long-held locks), so
    relays and producers never wait behind a large delete.
    """
    total = done = 0
    while max_batches is None or done < max_batches:
        deleted = delete_batch(batch)
        total += deleted
        done += 1
        if deleted < batch:
            break
    return total
