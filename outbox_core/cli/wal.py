"""``--source wal``: what ``relay``, ``install`` and ``uninstall`` do for log tailing.

The slot and publication are named by ``--slot`` / ``--publication`` (settings
``slot`` / ``publication``), by default ``outbox_<table>``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from collections.abc import Callable
from typing import Any, TypeVar

import click
import sqlalchemy as sa

from outbox_core.brokers.base import Broker
from outbox_core.config import Settings
from outbox_core.dialects.postgresql.wal import (
    ReplicationNotPermitted,
    WalStream,
    can_replicate,
    check_ready,
    create_publication,
    create_slot,
    drop_publication,
    drop_slot,
    require_logical_wal,
    slot_facts,
)
from outbox_core.dialects.postgresql.wal.table import SlotStatus, WalTable
from outbox_core.outbox import Outbox, Status
from outbox_core.redaction import mask_url
from outbox_core.relay.wal import PUBLISH, WalRelay, wal_names

F = TypeVar("F", bound=Callable[..., Any])


def source_options(func: F) -> F:
    """``--source table|wal``, ``--slot``, ``--publication`` (settings of the same names)."""
    options = [
        click.option(
            "--source",
            type=click.Choice(["table", "wal"]),
            help="Read events by polling the table, or from PostgreSQL's log [default: table].",
        ),
        click.option("--slot", help="Log tailing: replication slot [default: outbox_<table>]."),
        click.option("--publication", help="Log tailing: publication [default: outbox_<table>]."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _connect(outbox: Outbox, *, logical: bool = True) -> sa.Connection:
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


def check_wal(outbox: Outbox) -> None:
    """Refuse log tailing where it cannot work: not PostgreSQL, wal_level, no REPLICATION."""
    with _connect(outbox) as conn:
        if not can_replicate(conn):
            raise ReplicationNotPermitted(
                "the role has neither REPLICATION nor superuser: ALTER ROLE <role> WITH "
                "REPLICATION (or run install as a role that has it)"
            )


def install_wal(outbox: Outbox, settings: Settings) -> tuple[str, str, bool, bool]:
    """Create the publication, then the slot; (slot, publication, made each)."""
    slot, publication = wal_names(settings)
    table = outbox.table
    check_wal(outbox)
    with _connect(outbox) as conn:
        schema = table.schema or str(conn.execute(sa.text("SELECT current_schema()")).scalar())
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
            wal_table.forget_progress(conn, slot)
            conn.commit()  # a slot is created in a transaction that wrote nothing
            create_slot(conn, slot)
        conn.commit()
    return slot, publication, made_slot, made_publication


def uninstall_wal(outbox: Outbox, settings: Settings) -> tuple[str, str, bool]:
    """Drop the slot (its retained WAL is freed), the publication and ``<table>_wal``;
    the outbox table stays."""
    slot, publication = wal_names(settings)
    with _connect(outbox, logical=False) as conn:
        dropped = drop_slot(conn, slot)
        drop_publication(conn, publication)
        conn.commit()
        WalTable(outbox.dialect).uninstall(conn)
    return slot, publication, dropped


def wal_status(outbox: Outbox, settings: Settings) -> SlotStatus:
    """The slot, its lag, its relay's last report (``outbox status --source wal``)."""
    slot, _ = wal_names(settings)
    with _connect(outbox, logical=False) as conn:
        return WalTable(outbox.dialect).slot_status(conn, slot)


def with_log_tailing(status: Status, tailing: SlotStatus) -> Status:
    """``outbox status --source wal``: the stream's figures instead of the table's.

    Rows stay pending once published, so neither their age nor their
    ``sent_at`` says anything: what is out is what the reading relay published
    (none known while no relay reads).
    """
    return dataclasses.replace(
        status,
        log_tailing=dataclasses.asdict(tailing),
        oldest_pending_age=None,
        sent_last_minute=tailing.published_last_minute or 0,
        last_sent_age=None,
    )


def wal_relay(outbox: Outbox, broker: Broker, settings: Settings, name: str | None) -> WalRelay:
    """A :class:`WalRelay` of the outbox, after checking the server, slot and publication."""
    slot, publication = wal_names(settings)
    with _connect(outbox) as conn:
        table = (outbox.table.schema, outbox.table.name)
        problems = check_ready(conn, slot=slot, publication=publication, table=table)
        schema = outbox.table.schema or str(
            conn.execute(sa.text("SELECT current_schema()")).scalar()
        )
        missing = [] if problems else WalTable(outbox.dialect).missing(conn)
    if problems:
        reasons = "; ".join(str(p) for p in problems)
        raise type(problems[0])(
            f"cannot tail the log of {mask_url(outbox.url.render_as_string(hide_password=False))}: "
            f"{reasons} "
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
    url = outbox.url
    name = name or f"wal-{socket.gethostname().split('.')[0][:20]}-{os.getpid()}"

    def open_stream(**options: Any) -> WalStream:
        # The relay's name as application_name: pg_stat_replication shows who reads.
        return WalStream(
            url,
            slot=slot,
            publication=publication,
            tables=[(schema, outbox.table.name)],
            application_name=name[:63],
            **options,
        )

    return WalRelay(outbox.engine, outbox.dialect, broker, settings, open_stream, name=name)
