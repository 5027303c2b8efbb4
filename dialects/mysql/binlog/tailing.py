"""MySQL/MariaDB's log tailing (``--source binlog``): the outbox table's rows from the binlog.

What ``outbox install``, ``uninstall``, ``status`` and ``relay`` do with
``--source binlog``: the server's binlog settings checked (ROW format, FULL
row image, GTIDs, the replication privileges), ``<table>_wal`` with the
source's starting position (the binlog's end at install), and the source
a relay reads; registered for the ``mysql`` dialect by this package.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import sqlalchemy as sa

from outbox_core.config import Settings
from outbox_core.dialects.mysql.binlog.errors import BinlogNotReady, BinlogPurged
from outbox_core.dialects.mysql.binlog.names import source_name
from outbox_core.dialects.mysql.binlog.server import (
    BinlogServer,
    Retention,
    purged_past,
    read_server,
    retention,
)
from outbox_core.dialects.mysql.binlog.source import BinlogSource
from outbox_core.dialects.mysql.binlog.table import BinlogTable
from outbox_core.outbox import Outbox
from outbox_core.redaction import mask_url
from outbox_core.relay.tailing import ScratchSource, TailingStatus

log = logging.getLogger("outbox")

#: What ``names()`` gives as the second name: the binlog has no publication.
BINLOG = "binlog"


def ready_server(conn: sa.Connection, outbox: Outbox) -> BinlogServer:
    """The server, refused with every change it needs (:class:`BinlogNotReady`)."""
    server = read_server(conn)
    problems = server.problems()
    if problems:
        shown = mask_url(outbox.url.render_as_string(hide_password=False))
        raise BinlogNotReady(f"cannot tail the binlog of {shown}: " + "; ".join(problems))
    return server


def current_schema(conn: sa.Connection, outbox: Outbox) -> str:
    """The outbox table's database (its schema, or the connection's current one)."""
    return outbox.table.schema or str(conn.execute(sa.text("SELECT DATABASE()")).scalar())


@dataclass(frozen=True)
class BinlogStatus(TailingStatus):
    """``outbox status --source binlog``: the source's status and the binlog's figures.

    Positions are GTIDs, not byte offsets, so ``lag_bytes`` and ``unread_bytes``
    are None; the lag is ``lag_transactions`` (committed past the confirmed
    GTID, in the server's GTID domain) and, in seconds, ``oldest_unpublished_age``.
    ``retained_bytes`` is the binlog the server keeps (``SHOW BINARY LOGS``).
    """

    #: The binlog's last GTID (nothing committed lies beyond it).
    binlog_end: str | None = None
    #: Transactions committed past the confirmed GTID (the source's lag).
    lag_transactions: int | None = None
    #: Binlog files the server keeps.
    binlog_files: int | None = None
    #: Seconds after which the server purges a binlog (0: never by age).
    binlog_expire_seconds: float | None = None


class BinlogTailing:
    """MySQL/MariaDB's :class:`~outbox_core.relay.tailing.LogTailing`."""

    kind = "binlog"

    def names(self, settings: Settings) -> tuple[str, str]:
        """The source (``--slot``, else ``outbox_<table>``) and ``"binlog"``."""
        return source_name(settings), BINLOG

    def check(self, outbox: Outbox) -> None:
        """Refuse where the binlog cannot be tailed, saying exactly what to change."""
        BinlogTable(outbox.dialect)  # not MySQL/MariaDB: refused without a connection
        with outbox.engine.connect() as conn:
            ready_server(conn, outbox)

    def install(self, outbox: Outbox, settings: Settings) -> tuple[str, str, bool, bool]:
        """``<table>_wal`` and the deferred index; the source's position at the binlog's end
        unless it has one still in the binlog. (source, "binlog", position made, False)."""
        name = source_name(settings)
        table = BinlogTable(outbox.dialect)
        with outbox.engine.connect() as conn:
            server = ready_server(conn, outbox)
            table.install(conn)
            settled = table.progress.settled(conn, name)
            purged = None if settled is None else purged_past(conn, server, settled)
            if purged is not None:
                log.warning("%s: the source starts again at the binlog's end", purged)
            made = settled is None or purged is not None
            if made:
                # Events committed from now on are read; older ones are the table's.
                table.progress.report(
                    conn, slot=name, relay="install", confirmed_lsn=server.end, held=0,
                    oldest_held_at=None, durable=True,
                )  # fmt: skip
            conn.commit()  # the report joined the transaction the reads above began
        return name, BINLOG, made, False

    def uninstall(self, outbox: Outbox, settings: Settings) -> tuple[str, str, bool]:
        """Drop ``<table>_wal`` (the source's position) and the index; the table stays."""
        name = source_name(settings)
        table = BinlogTable(outbox.dialect)
        with outbox.engine.connect() as conn:
            existed = table.progress.settled(conn, name) is not None
            table.uninstall(conn)
        return name, BINLOG, existed

    def _source(self, outbox: Outbox, settings: Settings, relay: str) -> BinlogSource:
        table = BinlogTable(outbox.dialect)
        with outbox.engine.connect() as conn:
            schema = current_schema(conn, outbox)
        return BinlogSource(
            outbox.engine, outbox.dialect, name=source_name(settings), schema=schema,
            relay=relay, table=table,
        )  # fmt: skip

    def status(self, outbox: Outbox, settings: Settings) -> TailingStatus:
        """The source, its reader, its relay's last report, and the binlog: its end, the
        transactions past the confirmed position, the files kept (:class:`BinlogStatus`)."""
        source = self._source(outbox, settings, "status")
        with outbox.engine.connect() as conn:
            server = read_server(conn)
            facts = source.facts(conn, server)
            status = source.table.source_status(conn, source.name, facts, server.describe)
            if facts is None or facts.confirmed is None:
                return status
            try:
                kept: Retention | None = retention(conn)
            except sa.exc.DBAPIError:
                kept = None
        return BinlogStatus(
            **{f.name: getattr(status, f.name) for f in dataclasses.fields(TailingStatus)},
            binlog_end=server.describe(server.end),
            lag_transactions=facts.lag_transactions,
            binlog_files=None if kept is None else kept.files,
            binlog_expire_seconds=None if kept is None else kept.expire_seconds,
        )

    def source(self, outbox: Outbox, settings: Settings, relay: str) -> BinlogSource:
        """The source a relay named ``relay`` reads, after checking the server, the
        source's position (installed, still in the binlog) and ``<table>_wal``."""
        source = self._source(outbox, settings, relay)
        with outbox.engine.connect() as conn:
            server = ready_server(conn, outbox)
            missing = source.table.missing(conn)
            settled = None if missing else source.table.progress.settled(conn, source.name)
            why = None if settled is None else purged_past(conn, server, settled)
        shown = mask_url(outbox.url.render_as_string(hide_password=False))
        if missing or settled is None:
            raise BinlogNotReady(
                f"cannot tail the binlog of {shown}: no position for {source.name!r} "
                "(`outbox install --source binlog` starts it at the binlog's end)"
            )
        if why is not None:
            raise BinlogPurged(f"cannot tail the binlog of {shown}: {why}")
        return source

    @contextmanager
    def scratch(self, outbox: Outbox) -> Iterator[ScratchSource]:
        """A throwaway source of ``outbox``'s temporary table (``outbox verify``): its
        ``<table>_wal`` at the binlog's end, dropped after; :class:`TailingUnavailable`
        with what to set where the binlog cannot be tailed."""
        # Imported here: the rest of this module needs none of verify's scratch source.
        from outbox_core.dialects.mysql.binlog.scratch import scratch_binlog

        with scratch_binlog(outbox) as made:
            yield made
