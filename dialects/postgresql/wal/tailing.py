"""PostgreSQL's log tailing (``--source wal``): logical replication of the outbox table.

What ``outbox install``, ``uninstall``, ``status`` and ``relay`` do with
``--source wal`` on PostgreSQL: a publication of the table (inserts, and
updates for replays), a logical slot (plugin ``pgoutput``) and ``<table>_wal``;
registered for the ``postgresql`` dialect by this package.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import sqlalchemy as sa

from outbox_core.config import Settings
from outbox_core.dialects.postgresql.wal.errors import ReplicationNotPermitted
from outbox_core.dialects.postgresql.wal.names import PUBLISH, wal_names
from outbox_core.dialects.postgresql.wal.scratch import ScratchSlot, scratch_slot
from outbox_core.dialects.postgresql.wal.slots import (
    can_replicate,
    check_ready,
    create_publication,
    create_slot,
    drop_publication,
    drop_slot,
    require_logical_wal,
    slot_facts,
)
from outbox_core.dialects.postgresql.wal.source import SlotSource
from outbox_core.dialects.postgresql.wal.table import WalTable
from outbox_core.outbox import Outbox
from outbox_core.redaction import mask_url
from outbox_core.relay.tailing import TailingStatus


def connect(outbox: Outbox, *, logical: bool = True) -> sa.Connection:
    """A connection to the outbox's PostgreSQL (``logical``: refused unless wal_level is)."""
    # Refused without a connection (and none to a server that may not answer).
    WalTable(outbox.dialect)
    conn = outbox.engine.connect()
    if not logical:
        return conn
    try:
        require_logical_wal(conn)
    except BaseException:
        conn.close()
        raise
    return conn


def current_schema(conn: sa.Connection, outbox: Outbox) -> str:
    """The outbox table's schema (its own, or the connection's current one)."""
    return outbox.table.schema or str(conn.execute(sa.text("SELECT current_schema()")).scalar())


class LogicalReplication:
    """PostgreSQL's :class:`~outbox_core.relay.tailing.LogTailing`."""

    kind = "wal"

    def names(self, settings: Settings) -> tuple[str, str]:
        """The slot and publication: the settings' or ``outbox_<table>`` (lower-case)."""
        return wal_names(settings)

    def check(self, outbox: Outbox) -> None:
        """Refuse log tailing where it cannot work: not PostgreSQL, wal_level, no REPLICATION."""
        with connect(outbox) as conn:
            if not can_replicate(conn):
                raise ReplicationNotPermitted(
                    "the role has neither REPLICATION nor superuser: ALTER ROLE <role> WITH "
                    "REPLICATION (or run install as a role that has it)"
                )

    def install(self, outbox: Outbox, settings: Settings) -> tuple[str, str, bool, bool]:
        """Create the publication, then the slot; (slot, publication, made each)."""
        slot, publication = wal_names(settings)
        table = outbox.table
        self.check(outbox)
        with connect(outbox) as conn:
            schema = current_schema(conn, outbox)
            # The publication before the slot: the slot decodes with the catalog of its time.
            made_publication = create_publication(
                conn, publication, table=table.name, schema=schema, publish=PUBLISH
            )
            conn.commit()
            # Where the relay reports its progress, and the index of events handed back.
            wal_table = WalTable(outbox.dialect)
            wal_table.install(conn)
            made_slot = slot_facts(conn, slot) is None
            if made_slot:
                # A progress row of an earlier slot of this name would skip the new one's log.
                wal_table.progress.forget(conn, slot)
                conn.commit()  # a slot is created in a transaction that wrote nothing
                create_slot(conn, slot)
            conn.commit()
        return slot, publication, made_slot, made_publication

    def uninstall(self, outbox: Outbox, settings: Settings) -> tuple[str, str, bool]:
        """Drop the slot (its retained WAL is freed), the publication and ``<table>_wal``;
        the outbox table stays."""
        slot, publication = wal_names(settings)
        with connect(outbox, logical=False) as conn:
            dropped = drop_slot(conn, slot)
            drop_publication(conn, publication)
            conn.commit()
            WalTable(outbox.dialect).uninstall(conn)
        return slot, publication, dropped

    def status(self, outbox: Outbox, settings: Settings) -> TailingStatus:
        """The slot, its lag, its relay's last report (``outbox status --source wal``)."""
        slot, _ = wal_names(settings)
        with connect(outbox, logical=False) as conn:
            return WalTable(outbox.dialect).slot_status(conn, slot)

    def source(self, outbox: Outbox, settings: Settings, relay: str) -> SlotSource:
        """The slot a relay named ``relay`` reads, after checking the server, slot and
        publication."""
        slot, publication = wal_names(settings)
        table = WalTable(outbox.dialect)
        with connect(outbox) as conn:
            where = (outbox.table.schema, outbox.table.name)
            problems = check_ready(conn, slot=slot, publication=publication, table=where)
            schema = current_schema(conn, outbox)
            missing = [] if problems else table.missing(conn)
        if problems:
            reasons = "; ".join(str(p) for p in problems)
            shown = mask_url(outbox.url.render_as_string(hide_password=False))
            raise type(problems[0])(
                f"cannot tail the log of {shown}: {reasons} "
                f"(`outbox install --source wal` creates the slot and publication)"
            )
        if missing:
            logging.getLogger("outbox.relay").warning(
                "%s missing (the table was installed before them): status and doctor see less "
                "of the stream, a relay restarted after a server crash may resend more, and "
                "events waiting in the table are found slowly; run `outbox install --source wal` "
                "again",
                " and ".join(missing),
            )
        return SlotSource(
            outbox.url,
            outbox.dialect,
            slot=slot,
            publication=publication,
            tables=[(schema, outbox.table.name)],
            relay=relay,
            table=table,
            # The relay's name as application_name: pg_stat_replication shows who reads.
            application_name=relay[:63],
        )

    @contextmanager
    def scratch(self, outbox: Outbox) -> Iterator[ScratchSlot]:
        """A throwaway slot and publication of ``outbox``'s temporary table."""
        with scratch_slot(outbox) as made:
            yield made
