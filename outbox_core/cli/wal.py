"""``--source wal``: what ``relay``, ``install``, ``uninstall`` and ``status`` do for log tailing.

Each asks the database's log tailing (:func:`~outbox_core.relay.tailing.log_tailing`:
PostgreSQL's logical replication); the slot and publication are named by
``--slot`` / ``--publication`` (settings ``slot`` / ``publication``), by
default ``outbox_<table>``.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Callable
from typing import Any, TypeVar

import click

from outbox_core.brokers.base import Broker
from outbox_core.config import Settings
from outbox_core.outbox import Outbox, Status
from outbox_core.relay.tailing import TailingRelay, TailingStatus, log_tailing

F = TypeVar("F", bound=Callable[..., Any])


def source_options(func: F) -> F:
    """``--source table|wal|binlog``, ``--slot``, ``--publication`` (settings of the same
    names)."""
    options = [
        click.option(
            "--source",
            type=click.Choice(["table", "wal", "binlog"]),
            help="Read events by polling the table, from PostgreSQL's log (wal) or from "
            "MySQL/MariaDB's binlog [default: table].",
        ),
        click.option("--slot", help="Log tailing: replication slot [default: outbox_<table>]."),
        click.option("--publication", help="Log tailing: publication [default: outbox_<table>]."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def check_wal(outbox: Outbox) -> None:
    """Refuse log tailing where it cannot work (the database, its settings, the role)."""
    log_tailing(outbox.dialect, outbox.settings.source).check(outbox)


def install_wal(outbox: Outbox, settings: Settings) -> tuple[str, str, bool, bool]:
    """Make what log tailing reads; (slot, publication, made each)."""
    return log_tailing(outbox.dialect, settings.source).install(outbox, settings)


def uninstall_wal(outbox: Outbox, settings: Settings) -> tuple[str, str, bool]:
    """Drop what log tailing reads (its retained log is freed); the outbox table stays."""
    return log_tailing(outbox.dialect, settings.source).uninstall(outbox, settings)


def wal_status(outbox: Outbox, settings: Settings) -> TailingStatus:
    """The slot, its lag, its relay's last report (``outbox status --source wal``)."""
    return log_tailing(outbox.dialect, settings.source).status(outbox, settings)


def with_log_tailing(status: Status, tailing: TailingStatus) -> Status:
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


def tailing_relay(
    outbox: Outbox, broker: Broker, settings: Settings, name: str | None
) -> TailingRelay:
    """A :class:`TailingRelay` of the outbox, after checking the server, slot and publication."""
    name = name or f"wal-{socket.gethostname().split('.')[0][:20]}-{os.getpid()}"
    source = log_tailing(outbox.dialect, settings.source).source(outbox, settings, name)
    return TailingRelay(outbox.engine, broker, settings, source, name=name)
