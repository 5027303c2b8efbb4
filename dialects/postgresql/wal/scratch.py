"""A throwaway slot for ``outbox verify``'s log-tailing rows, dropped whatever happens.

Each check gets the usual temporary outbox table plus a publication of it
and a logical replication slot (plugin ``pgoutput``), both named after the
table (``outbox_verify_<random>``), made by :func:`scratch_slot` and dropped
in its ``finally`` whatever happened: a slot left behind keeps WAL on the
server's disk for ever. While a check runs, its session holds an advisory
lock on the slot's name; a slot or publication named ``outbox_verify_*`` in
this database that nobody reads and whose lock is free is what a verify run
that died left behind, and the next check drops it (and says so).

Where log tailing cannot run (``wal_level`` not ``logical``, a role without
REPLICATION or superuser, psycopg2 missing, no free replication slot or WAL
sender) :class:`~outbox_core.relay.tailing.TailingUnavailable` says why.
"""

from __future__ import annotations

import re
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Self

import sqlalchemy as sa

from outbox_core.dialects.base.tailing.scratch import Remembering, Scratch, scratch_source
from outbox_core.dialects.postgresql.wal.errors import SlotInUse, WalLevelNotLogical
from outbox_core.dialects.postgresql.wal.names import parse_lsn
from outbox_core.dialects.postgresql.wal.pgoutput import WalError
from outbox_core.dialects.postgresql.wal.slots import (
    can_replicate,
    create_publication,
    create_slot,
    drop_publication,
    drop_slot,
    require_logical_wal,
    slot_facts,
)
from outbox_core.dialects.postgresql.wal.source import SlotReader, SlotSource
from outbox_core.dialects.postgresql.wal.stream import WalStream
from outbox_core.outbox import Outbox
from outbox_core.relay.tailing import TailingUnavailable

#: How long creating the slot may wait for transactions open elsewhere to end.
SLOT_CREATE_TIMEOUT = 30.0
#: How long dropping the slot may wait for a closed reader's WAL sender to exit.
DROP_WITHIN = 15.0
#: The advisory lock class of live verify slots (``pg_try_advisory_lock(int, int)``).
LOCK_CLASS = "outbox_verify"
#: Slots and publications of verify runs (LIKE pattern; ``_`` escaped).
PREFIX = r"outbox\_verify\_%"
#: Exactly the names :func:`~outbox_core.verify.harness.temporary_table` makes.
VERIFY_NAME = re.compile(r"outbox_verify_[0-9a-f]{10}")


class ScratchSlotSource(Remembering[WalStream], SlotSource):
    """The scratch slot's source: every stream it opens is closed with the scratch slot."""

    def stream(self, **options: Any) -> WalStream:
        """A new stream of the slot, remembered for the teardown."""
        return self.remember(super().stream(**options))


@dataclass
class ScratchSlot(Scratch[WalStream]):
    """One check's temporary outbox table, its publication and slot, the streams opened."""

    slot: str
    publication: str

    @classmethod
    def begin(cls, outbox: Outbox, guard: sa.Connection) -> Self:
        """The slot and publication of ``outbox``'s temporary table, once log tailing is
        found possible (:func:`needs_log_tailing`); leftovers dropped, the check's lock
        held by ``guard``."""
        name = outbox.table.name
        needs_log_tailing(guard)
        schema = outbox.table.schema or str(
            guard.execute(sa.text("SELECT current_schema()")).scalar()
        )
        guard.commit()
        dropped = drop_abandoned(guard)
        # Held until the slot is dropped: the mark of a live check for drop_abandoned.
        _try_lock(guard, name)
        guard.commit()
        return cls(outbox, schema, name, name, dropped=dropped)

    def create(self, guard: sa.Connection) -> None:
        """The publication, then the slot."""
        # The publication before the slot: the slot decodes with the catalog of its
        # time. Inserts and updates, as `outbox install --source wal` makes it.
        create_publication(
            guard, self.publication, table=self.outbox.table.name, schema=self.schema,
            publish=("insert", "update"),
        )  # fmt: skip
        guard.commit()
        _make_slot(guard, self.slot)

    def source(self, relay: str) -> ScratchSlotSource:
        """The slot as a relay named ``relay`` reads it."""
        return ScratchSlotSource(
            self.outbox.url,
            self.outbox.dialect,
            slot=self.slot,
            publication=self.publication,
            tables=[(self.schema, self.outbox.table.name)],
            relay=relay,
            opened=self.opened,
            wal_sender_timeout=30.0,
            application_name="outbox-verify",
        )

    def reader(self, *, status_interval: float = 10.0) -> SlotReader:
        """A reader from the slot's confirmed position (closed by :func:`scratch_slot`)."""
        source = self.source("verify")
        return SlotReader(source.stream(status_interval=status_interval), source.events)

    def confirmed(self) -> int:
        """The slot's ``confirmed_flush_lsn`` as the server shows it (0 before any)."""
        with self.outbox.engine.connect() as conn:
            facts = slot_facts(conn, self.slot)
        if facts is None:
            raise WalError(f"the replication slot {self.slot} is gone")
        return facts.confirmed_flush_lsn or 0

    def position(self) -> int:
        """The server's current WAL insert position."""
        with self.outbox.engine.connect() as conn:
            return parse_lsn(
                str(conn.execute(sa.text("SELECT pg_current_wal_insert_lsn()")).scalar())
            )

    def drop(self) -> str | None:
        """Drop the slot (waiting for its WAL sender) and the publication; None when both
        are gone, else what to run by hand."""
        deadline = time.monotonic() + DROP_WITHIN
        while True:
            try:
                with self.outbox.engine.connect() as conn:
                    drop_slot(conn, self.slot)
                    drop_publication(conn, self.publication)
                    conn.commit()
                return None
            except SlotInUse:
                if time.monotonic() > deadline:
                    return (
                        f"the replication slot {self.slot} was still in use {DROP_WITHIN:.0f}s "
                        f"after its readers were closed; it keeps WAL until dropped: "
                        f"SELECT pg_drop_replication_slot('{self.slot}')"
                    )
                time.sleep(0.1)
            except Exception as exc:
                return (
                    f"dropping the replication slot {self.slot} failed ({type(exc).__name__}: "
                    f"{str(exc).splitlines()[0] if str(exc) else ''}); it keeps WAL until "
                    f"dropped: SELECT pg_drop_replication_slot('{self.slot}'); "
                    f"DROP PUBLICATION {self.publication}"
                )


def needs_log_tailing(conn: sa.Connection) -> None:
    """Raise :class:`TailingUnavailable`, with the reason, where a log-tailing relay could
    not run."""
    try:
        import psycopg2  # noqa: F401
    except ImportError:
        raise TailingUnavailable(
            "reading a replication slot needs psycopg2: pip install 'outbox-toolkit[wal]'"
        ) from None
    try:
        require_logical_wal(conn)
    except WalLevelNotLogical as exc:
        raise TailingUnavailable(str(exc)) from None
    if not can_replicate(conn):
        raise TailingUnavailable(
            "the role has neither REPLICATION nor superuser, which reading a replication "
            "slot needs (ALTER ROLE ... WITH REPLICATION)"
        )
    if conn.execute(sa.text("SELECT pg_is_in_recovery()")).scalar():
        raise TailingUnavailable(
            "the server is a standby: the outbox and its publication live on the primary"
        )
    slots, senders = conn.execute(
        sa.text(
            "SELECT current_setting('max_replication_slots')::int "
            "- (SELECT count(*) FROM pg_replication_slots), "
            "current_setting('max_wal_senders')::int "
            "- (SELECT count(*) FROM pg_stat_replication)"
        )
    ).one()
    if slots < 1:
        raise TailingUnavailable("no free replication slot (max_replication_slots are all in use)")
    if senders < 1:
        raise TailingUnavailable("no free WAL sender (max_wal_senders are all in use)")


def _try_lock(conn: sa.Connection, name: str) -> bool:
    return bool(
        conn.execute(
            sa.text("SELECT pg_try_advisory_lock(hashtext(:kind), hashtext(:name))"),
            {"kind": LOCK_CLASS, "name": name},
        ).scalar()
    )


def _unlock(conn: sa.Connection, name: str) -> None:
    conn.execute(
        sa.text("SELECT pg_advisory_unlock(hashtext(:kind), hashtext(:name))"),
        {"kind": LOCK_CLASS, "name": name},
    )


def drop_abandoned(conn: sa.Connection) -> list[str]:
    """Drop the slots and publications verify runs that died left in this database.

    A name ``outbox_verify_*`` counts as abandoned when no reader has its
    slot and no session holds its advisory lock (every live check holds its
    own from before it creates either until after it dropped both; a
    session that dies releases it). The names dropped.
    """
    slots = conn.execute(
        sa.text(
            "SELECT slot_name FROM pg_replication_slots WHERE slot_name LIKE :prefix "
            "AND database = current_database() AND NOT active"
        ),
        {"prefix": PREFIX},
    ).scalars()
    publications = conn.execute(
        sa.text("SELECT pubname FROM pg_publication WHERE pubname LIKE :prefix"),
        {"prefix": PREFIX},
    ).scalars()
    dropped = []
    for name in sorted(set(slots) | set(publications)):
        # Only verify's own names: a user's table verify_<x> has a slot outbox_verify_<x>
        # too, but its publication publishes verify_<x>, not a table of the slot's name.
        if not VERIFY_NAME.fullmatch(name) or not _publishes_only_itself(conn, name):
            continue
        if not _try_lock(conn, name):
            continue  # a live check's
        try:
            drop_slot(conn, name)
            drop_publication(conn, name)
            dropped.append(name)
        except (WalError, sa.exc.DBAPIError):
            conn.rollback()  # taken by a reader meanwhile, or not ours: left alone
        finally:
            _unlock(conn, name)
            conn.commit()
    return dropped


def _publishes_only_itself(conn: sa.Connection, name: str) -> bool:
    """The publication ``name`` (if any) publishes no table but one named ``name``."""
    tables = conn.execute(
        sa.text("SELECT tablename FROM pg_publication_tables WHERE pubname = :name"),
        {"name": name},
    ).scalars()
    return set(tables) <= {name}


def _make_slot(guard: sa.Connection, name: str) -> None:
    """Create the slot ``name``, waiting at most :data:`SLOT_CREATE_TIMEOUT` for the
    transactions open elsewhere."""
    guard.execute(sa.text(f"SET statement_timeout = '{SLOT_CREATE_TIMEOUT:.0f}s'"))
    guard.commit()  # a slot is created in a transaction that wrote nothing
    try:
        create_slot(guard, name)
    except WalError as exc:
        guard.rollback()
        text = str(exc)
        if "statement timeout" in text:
            raise TailingUnavailable(
                f"creating a replication slot waited {SLOT_CREATE_TIMEOUT:.0f}s for "
                "transactions open elsewhere to end (logical decoding starts after "
                "them): run verify when none is open"
            ) from None
        if "replication slots are in use" in text:
            raise TailingUnavailable("no free replication slot (max_replication_slots)") from None
        raise
    guard.commit()
    guard.execute(sa.text("RESET statement_timeout"))
    guard.commit()


def scratch_slot(outbox: Outbox) -> AbstractContextManager[ScratchSlot]:
    """The publication and slot of ``outbox``'s temporary table; both dropped after.

    Raises :class:`TailingUnavailable` where log tailing cannot run
    (:func:`needs_log_tailing`). The slot is dropped in ``finally``; if that
    fails too, :class:`ScratchLeftBehind` says how to drop it by hand.
    """
    return scratch_source(outbox, ScratchSlot)
