"""Which database tails its log how: one :class:`LogTailing` per dialect name.

A dialect's package holds its log tailing in a module ``wal`` beside the
dialect class (``outbox_core.dialects.<name>.wal``), which registers it here
when imported; :func:`log_tailing` imports it on first use. The relay, the
CLI, status, metrics and ``outbox verify`` reach a database's log only
through what this gives.
"""

from __future__ import annotations

import importlib
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol

from outbox_core.errors import OutboxError, UnsupportedDatabase
from outbox_core.relay.tailing.source import LogReader, LogSource
from outbox_core.relay.tailing.status import TailingStatus

if TYPE_CHECKING:
    from outbox_core.config import Settings
    from outbox_core.dialects.base import Dialect
    from outbox_core.outbox import Outbox


class TailingUnavailable(OutboxError):
    """Log tailing cannot run on this server, and why (``outbox verify`` skips)."""


class ScratchLeftBehind(OutboxError):
    """A scratch source could not be dropped: the message says what to run by hand."""


class ScratchSource(Protocol):
    """A throwaway source of a temporary outbox table (``outbox verify``), dropped after."""

    #: Sources of verify runs that died, dropped before this one was made.
    dropped: list[str]

    def source(self, relay: str) -> LogSource:
        """The source, for a relay named ``relay``."""

    def reader(self, *, status_interval: float = 10.0) -> LogReader:
        """A reader from the source's confirmed position (closed with the scratch source);
        ``status_interval``: how often it tells the server its position unasked."""

    def confirmed(self) -> int:
        """The source's confirmed position as the server shows it."""

    def position(self) -> int:
        """The server's current log position (what commits next lies past it)."""


class LogTailing(Protocol):
    """One database's log tailing: what ``--source wal`` asks of it."""

    #: The ``--source`` value that reads this log: ``wal`` (PostgreSQL), ``binlog`` (MySQL).
    kind: str

    def names(self, settings: Settings) -> tuple[str, str]:
        """The source's names (PostgreSQL: the slot and the publication)."""

    def check(self, outbox: Outbox) -> None:
        """Refuse, with the reason, where log tailing cannot work."""

    def install(self, outbox: Outbox, settings: Settings) -> tuple[str, str, bool, bool]:
        """Make what log tailing reads; (slot, publication, made each)."""

    def uninstall(self, outbox: Outbox, settings: Settings) -> tuple[str, str, bool]:
        """Drop it (the outbox table stays); (slot, publication, the slot was there)."""

    def status(self, outbox: Outbox, settings: Settings) -> TailingStatus:
        """The source, its lag, its relay's last report."""

    def source(self, outbox: Outbox, settings: Settings, relay: str) -> LogSource:
        """The source a relay named ``relay`` reads, once the server is checked ready."""

    def scratch(self, outbox: Outbox) -> AbstractContextManager[ScratchSource]:
        """A throwaway source of ``outbox``'s (temporary) table; raises
        :class:`TailingUnavailable` where log tailing cannot run."""


_TAILING: dict[str, LogTailing] = {}


def register_log_tailing(name: str, tailing: LogTailing) -> None:
    """Serve the dialect named ``name`` (``Dialect.name``) with ``tailing``."""
    _TAILING[name] = tailing


def log_tailing(dialect: Dialect, source: str | None = None) -> LogTailing:
    """The dialect's log tailing; :class:`~outbox_core.errors.UnsupportedDatabase` if none,
    or if it is not read by ``--source source``."""
    found = _TAILING.get(dialect.name)
    if found is None:
        module = f"{type(dialect).__module__}.wal"
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name is None or not module.startswith(exc.name):
                raise
        found = _TAILING.get(dialect.name)
    if found is None:
        raise UnsupportedDatabase(
            f"--source {source or 'wal'}: log tailing reads PostgreSQL's logical replication "
            f"(--source wal) or MySQL/MariaDB's binlog (--source binlog), not "
            f"{dialect.family}: use --source table"
        )
    if source not in (None, "table") and source != found.kind:
        raise UnsupportedDatabase(
            f"--source {source} does not read {dialect.family}'s log: use --source "
            f"{found.kind} (or --source table)"
        )
    return found
