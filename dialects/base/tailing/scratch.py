"""What every database's throwaway log-tailing source for ``outbox verify`` shares: its
lifetime on a guard connection, and a teardown whatever happens.

A database's scratch source (PostgreSQL: a slot and a publication; MySQL and
MariaDB: the progress row in ``<table>_wal``) is a :class:`Scratch`:
:meth:`Scratch.begin` checks the server on the guard connection, drops what
verify runs that died left behind and marks this check live with a lock the
guard holds; :meth:`Scratch.create` makes the source. :func:`scratch_source`
closes every reader opened and drops the source in its ``finally`` whatever
happened; if that fails too,
:class:`~outbox_core.relay.tailing.ScratchLeftBehind` says what to run by hand.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Protocol, Self, TypeVar

import sqlalchemy as sa

from outbox_core.relay.tailing import ScratchLeftBehind

if TYPE_CHECKING:
    from outbox_core.outbox import Outbox


class Closing(Protocol):
    """A reader (or stream) the scratch source closes before dropping the source."""

    def close(self) -> None:
        """End its connections (and free what it holds)."""


R = TypeVar("R", bound=Closing)


class Remembering(Generic[R]):
    """Mixed into a database's log source for a scratch source: the readers it opens are
    remembered in ``opened`` (the scratch source's list), to be closed at the teardown."""

    def __init__(self, *args: Any, opened: list[R], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.opened = opened

    def remember(self, made: R) -> R:
        """``made``, remembered for the teardown."""
        self.opened.append(made)
        return made


@dataclass
class Scratch(ABC, Generic[R]):
    """One check's temporary outbox table and its log-tailing source, with the readers
    opened (closed at the teardown, before the source is dropped)."""

    outbox: Outbox
    schema: str
    #: Leftovers of dead verify runs dropped before this check.
    dropped: list[str] = field(default_factory=list, kw_only=True)
    opened: list[R] = field(default_factory=list, kw_only=True)

    @classmethod
    @abstractmethod
    def begin(cls, outbox: Outbox, guard: sa.Connection) -> Self:
        """The scratch source of ``outbox``'s temporary table, nothing made yet: raises
        :class:`~outbox_core.relay.tailing.TailingUnavailable` where log tailing cannot
        run; drops what dead verify runs left; takes the live check's lock on ``guard``."""

    @abstractmethod
    def create(self, guard: sa.Connection) -> None:
        """Make the source (what ``outbox install`` makes for log tailing)."""

    @abstractmethod
    def drop(self) -> str | None:
        """Drop the source; None when it is gone, else what to run by hand."""

    def teardown(self) -> str | None:
        """Close the readers opened, then :meth:`drop` the source."""
        for reader in self.opened:
            # Closed already by a relay, or failing: the drop still goes ahead (and says
            # so where the source is still in use).
            with contextlib.suppress(Exception):
                reader.close()
        return self.drop()


S = TypeVar("S", bound=Scratch[Any])


@contextmanager
def scratch_source(outbox: Outbox, kind: type[S]) -> Iterator[S]:
    """``kind``'s scratch source of ``outbox``'s temporary table; torn down after.

    Raises :class:`~outbox_core.relay.tailing.TailingUnavailable` where log
    tailing cannot run (:meth:`Scratch.begin`). The teardown runs in
    ``finally``; if it fails, :class:`ScratchLeftBehind` says what to run by
    hand. The guard connection, and its lock, lives until the source is gone.
    """
    guard = outbox.engine.connect()
    made: S | None = None
    problem: BaseException | None = None
    try:
        made = kind.begin(outbox, guard)
        made.create(guard)
        yield made
    except BaseException as exc:
        problem = exc
        raise
    finally:
        try:
            left = made.teardown() if made is not None else None
        finally:
            guard.invalidate()  # its lock (and settings) go with the session
            guard.close()
        if left is not None:
            raise ScratchLeftBehind(left) from problem
