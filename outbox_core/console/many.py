"""Many outboxes on one dashboard: which outboxes there are now, and each one's overview line.

:class:`Outboxes` finds the outboxes the settings name
(:class:`~outbox_core.fleet.targets.Databases`: ``--db`` repeated,
``--schemas PATTERN``) again every few seconds, never more often, and
reads a page of them at a time: one connection per database, the
databases in parallel, each outbox's counts and relays read through its
dialect on that connection. A database that does not answer (down, or
slower than the deadline) is an error on its outboxes' lines; the other
lines are read all the same. Its outboxes, once found, stay listed while it
is down, so labels and links do not change under the operator.
"""

from __future__ import annotations

import dataclasses
import math
import string
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox_core.console.views import STALE_AFTER
from outbox_core.errors import OutboxError, translate_errors
from outbox_core.fleet.targets import Databases, Member, label
from outbox_core.redaction import mask_url, redact

#: What one database's reads may raise and leave the other lines to be read.
FAILURES = (OutboxError, sa.exc.SQLAlchemyError, OSError)
#: Characters a label keeps in its URL; any other is written ``~XX`` per byte.
SLUG_SAFE = frozenset(string.ascii_letters + string.digits + "_.-:")
#: Outboxes per overview page unless told otherwise.
PAGE_SIZE = 50


def slug(name: str) -> str:
    """``name`` as one URL path segment: ``tenant_a`` stays, ``a/b#1`` is ``a~2Fb~231``."""
    if set(name) <= {"."}:  # "." and ".." mean something in a path
        return "".join(f"~{b:02X}" for b in name.encode())
    return "".join(
        ch if ch in SLUG_SAFE else "".join(f"~{b:02X}" for b in ch.encode()) for ch in name
    )


def error_text(exc: BaseException) -> str:
    """An error's first line, passwords masked (what a line of the overview shows)."""
    text = str(exc).strip().splitlines()
    return redact(text[0] if text else type(exc).__name__)[:300]


@dataclass
class Tally:
    """One outbox's line on the overview (counts None: not read, ``error`` says why)."""

    label: str
    slug: str
    #: Its database's URL, password masked.
    database: str
    pending: int | None = None
    leased: int | None = None
    dead: int | None = None
    oldest_pending_age: float | None = None
    #: Relays whose heartbeat is recent, and those gone quiet (stale presence rows).
    relays: int | None = None
    stale_relays: int = 0
    error: str | None = None
    #: False for a database whose outboxes are unknown (it never answered): no pages.
    linked: bool = True

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (``/api/outboxes``)."""
        return dataclasses.asdict(self)


@dataclass
class FleetPage:
    """A page of the overview of many outboxes."""

    outboxes: list[Tally]
    #: This page's number (from 1), how many pages, outboxes matching the filter.
    number: int
    pages: int
    total: int
    size: int
    #: The filter: a piece of the label (empty: every outbox).
    query: str = ""
    #: Databases where the pattern matched no schema holding the table.
    empty: list[str] = field(default_factory=list)
    databases: int = 1

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (``/api/outboxes``)."""
        return dataclasses.asdict(self)


class Outboxes:
    """The outboxes of ``databases`` as the dashboard sees them: found again every
    ``rediscover`` seconds, read a page at a time, each database given ``deadline``
    seconds to answer."""

    def __init__(
        self,
        databases: Databases,
        *,
        rediscover: float = 5.0,
        deadline: float = 5.0,
        workers: int = 8,
    ) -> None:
        self.databases = databases
        self.bases = list(databases)
        self.rediscover = rediscover
        self.deadline = deadline
        self.pool = ThreadPoolExecutor(
            max_workers=max(1, min(workers, len(self.bases))), thread_name_prefix="outbox-dash"
        )
        self._lock = threading.Lock()
        self._found_at = -math.inf
        #: Every outbox found, and stand-ins for databases whose outboxes are unknown.
        self._members: list[Member] = []
        self._by_slug: dict[str, Member] = {}
        #: (database index, schema) -> its member: kept across finds (its Outbox reused).
        self._known: dict[tuple[int, str | None], Member] = {}
        self._names: dict[int, list[str | None]] = {}
        #: Why a database's outboxes could not be found (by id of its stand-in or members).
        self._failed: dict[int, str] = {}
        self._empty: list[str] = []
        self._stand_in: dict[int, Member] = {}
        #: The stand-ins: databases never answered, whose outboxes are unknown (no pages).
        self._stand_ins: set[int] = set()
        #: Outboxes whose presence table exists (checked until found).
        self._presence: set[int] = set()

    # -- finding ---------------------------------------------------------------------------

    def members(self, *, fresh: bool = False) -> list[Member]:
        """Every outbox now (and a stand-in per database that never answered), labelled;
        found again when the last find is older than ``rediscover`` seconds."""
        with self._lock:
            if fresh or time.monotonic() - self._found_at >= self.rediscover:
                self._find()
            return list(self._members)

    def labels(self) -> list[str]:
        """The labels of the outboxes found last (no database is asked)."""
        return [m.label for m in self._members if id(m) not in self._stand_ins]

    def member(self, slug_: str) -> Member | None:
        """The outbox whose label's slug is ``slug_``; an unknown one makes a new find (at
        most once a second, so a stray URL cannot keep the databases busy)."""
        found = self._by_slug.get(slug_)
        if found is None and time.monotonic() - self._found_at >= min(1.0, self.rediscover):
            self.members(fresh=True)
            found = self._by_slug.get(slug_)
        return found

    def by_label(self, name: str) -> Member | None:
        """The outbox labelled ``name`` (as :meth:`member`)."""
        return self.member(slug(name))

    def _find(self) -> None:
        futures = [self.pool.submit(self.databases.names_in, None, base) for base in self.bases]
        wait(futures, timeout=self.deadline)
        members: list[Member] = []
        failed: dict[int, str] = {}
        empty: list[str] = []
        stand_ins: set[int] = set()
        for index, (base, future) in enumerate(zip(self.bases, futures, strict=True)):
            database = mask_url(base.url)
            error = self._outcome(future)
            if error is None:
                self._names[index] = list(future.result())
                if not self._names[index]:
                    empty.append(database)
            names = self._names.get(index)
            if names is None:  # never answered: one line for the database
                stand_in = self._stand_in.setdefault(index, Member("", base, database))
                members.append(stand_in)
                stand_ins.add(id(stand_in))
                failed[id(stand_in)] = error or "not answered"
                continue
            for name in names:
                member = self._known.get((index, name))
                if member is None:
                    member = self.databases.members_in(base, [name])[0]
                    self._known[(index, name)] = member
                members.append(member)
                if error is not None:
                    failed[id(member)] = error
        self._failed, self._empty, self._found_at = failed, empty, time.monotonic()
        if [id(m) for m in members] == [id(m) for m in self._members]:
            return  # the same outboxes: labels stand (labelling hundreds takes a while)
        label(members)
        self._members, self._stand_ins = members, stand_ins
        self._by_slug = {slug(m.label): m for m in members if id(m) not in stand_ins}

    def _outcome(self, future: Future[Any]) -> str | None:
        """None when ``future`` ended well, else what went wrong (its error, or no answer)."""
        if not future.done():
            return f"no answer within {self.deadline:g}s"
        exc = future.exception()
        if exc is None:
            return None
        if isinstance(exc, FAILURES):
            return error_text(exc)
        raise exc

    # -- reading ---------------------------------------------------------------------------

    def page(self, number: int = 1, size: int = PAGE_SIZE, query: str = "") -> FleetPage:
        """Page ``number`` of the outboxes whose label holds ``query``, each one read."""
        everyone = self.members()
        needle = query.strip().lower()
        shown = [m for m in everyone if needle in m.label.lower()] if needle else everyone
        pages = max(1, math.ceil(len(shown) / size))
        number = min(max(1, number), pages)
        chunk = shown[(number - 1) * size : number * size]
        return FleetPage(
            outboxes=self.tallies(chunk),
            number=number,
            pages=pages,
            total=len(shown),
            size=size,
            query=query,
            empty=list(self._empty),
            databases=len(self.bases),
        )

    def tallies(self, members: Sequence[Member]) -> list[Tally]:
        """Each member's line: the members of one database read on one connection, the
        databases in parallel, each within the deadline."""
        lines = {id(m): self._line(m) for m in members}
        groups: dict[int, list[Member]] = {}
        for m in members:
            if lines[id(m)].error is None:
                groups.setdefault(id(m.outbox.engine), []).append(m)
        futures = {key: self.pool.submit(self._read, group) for key, group in groups.items()}
        wait(list(futures.values()), timeout=self.deadline)
        for key, future in futures.items():
            error = self._outcome(future)
            for m in groups[key]:
                line = lines[id(m)]
                if error is not None:
                    line.error = error
                else:
                    read: Tally = future.result()[id(m)]
                    lines[id(m)] = dataclasses.replace(read, label=line.label, slug=line.slug)
        return [lines[id(m)] for m in members]

    def _line(self, m: Member) -> Tally:
        return Tally(
            m.label,
            slug(m.label),
            m.database,
            error=self._failed.get(id(m)),
            linked=id(m) not in self._stand_ins,
        )

    def _read(self, group: list[Member]) -> dict[int, Tally]:
        """The lines of ``group`` (one database's outboxes) on one connection."""
        out: dict[int, Tally] = {}
        try:
            with group[0].outbox.engine.connect() as conn:
                for m in group:
                    out[id(m)] = self._tally(conn, m)
                    if out[id(m)].error is not None and conn.invalidated:
                        break  # the connection is gone: the rest would fail the same
        except FAILURES as exc:  # no connection at all, or lost while reading
            lost = error_text(exc)
        else:
            lost = "the connection was lost"
        for m in group:  # those left unread
            if id(m) not in out:
                out[id(m)] = self._line(m)
                out[id(m)].error = lost
        return out

    def _tally(self, conn: Connection, m: Member) -> Tally:
        line = self._line(m)
        dialect = m.outbox.dialect
        try:
            # One short read transaction for both reads: fewer round trips than one each.
            with translate_errors("dashboard"), conn.begin():
                counts = dialect.console.overview(conn)
                if id(m.outbox) not in self._presence and dialect.presence.installed(conn):
                    self._presence.add(id(m.outbox))
                rows = dialect.presence.fleet(conn) if id(m.outbox) in self._presence else []
        except FAILURES as exc:
            self._presence.discard(id(m.outbox))  # a table dropped since: check again
            line.error = error_text(exc)
            return line
        line.pending, line.leased, line.dead = counts.pending, counts.leased, counts.dead
        if counts.oldest_pending_created is not None:
            line.oldest_pending_age = max(
                0.0, (counts.now - counts.oldest_pending_created).total_seconds()
            )
        line.relays = sum(1 for r in rows if r.heartbeat_age <= STALE_AFTER)
        line.stale_relays = len(rows) - line.relays
        return line

    def close(self) -> None:
        """Stop the reading threads and dispose of the databases' engines."""
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.databases.close()


__all__ = ["PAGE_SIZE", "FleetPage", "Outboxes", "Tally", "error_text", "slug"]
