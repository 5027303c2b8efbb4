"""What a database can store: checked at enqueue and by ``outbox migrate`` (a part of Dialect)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, ClassVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox_core.errors import PayloadError
from outbox_core.message import NewEvent, find_in_json, json_depth


class StorageRules:
    """The storage rules of a database family; dialects override what differs."""

    #: ``enqueue`` binds payload and headers as the JSON text it already
    #: serialised (UTF-8) instead of letting the driver serialise them again
    #: (as ASCII with ``\\uXXXX`` escapes: three times the size for non-Latin text).
    json_as_text: ClassVar[bool] = False

    def text_problem(self, name: str, value: str) -> str | None:
        """Why this database cannot store the text ``value`` of ``name``, or None.

        Every database: a lone surrogate is not Unicode. Dialects add their own
        rules (PostgreSQL: no NUL).
        """
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return f"{name} contains a lone surrogate (not valid Unicode)"
        return None

    def json_suspect(self, text: str) -> bool:
        """Fast pre-check of serialised JSON: might :meth:`text_problem` refuse part of it?"""
        return False

    def json_problem(self, name: str, value: Any) -> str | None:
        """The first string (or key) of a JSON value this database cannot store, named."""
        return find_in_json(value, name, self.text_problem)

    #: Declared text lengths are limits (SQLite keeps any length it is given).
    enforces_lengths: ClassVar[bool] = True

    #: JSON columns are parsed by the database, which can refuse parts of them
    #: (elsewhere JSON is stored as the text it is).
    parses_json: ClassVar[bool] = False

    def text_storage(
        self, inspector: sa.Inspector, table: sa.Table, column_type: Any
    ) -> tuple[int | None, str | None]:
        """``(byte limit, codec)`` a reflected text column imposes beyond its length.

        The codec (a Python codec name, or ``bmp``: no character beyond
        U+FFFF) is set where the column's character set is narrower than
        Unicode. None, None: nothing beyond the length.
        """
        return None, None

    def text_length(self, value: str) -> int:
        """How this database counts the length of ``value`` against a column's length."""
        return len(value)

    def time_problem(self, name: str, value: datetime) -> str | None:
        """Why a timestamp column cannot hold ``value``, or None."""
        return None

    def time_digits(self, column_type: Any) -> int:
        """Fractional second digits a reflected timestamp column keeps."""
        precision = getattr(column_type, "precision", None)
        return 6 if precision is None else min(int(precision), 6)

    def bind_time(self, value: datetime | None) -> datetime | None:
        """A naive UTC timestamp as this database's timestamp columns take it."""
        return value

    def json_text(self, column: sa.ColumnElement[Any]) -> sa.ColumnElement[str]:
        """A JSON column read as the exact text the database holds (no decoding)."""
        return sa.type_coerce(column, sa.UnicodeText)

    def initialize(self, conn: Connection) -> None:
        """Set the capability flags that depend on the server, once, from ``conn``.

        Called before the first enqueue, by each relay connection before its
        session limits, and by migrate on its target. The class flags are
        what a family can do; this refines them for the server at hand
        (MySQL: MariaDB or not, ``max_allowed_packet``). The default reads nothing.
        """
        self.initialized = True

    #: :meth:`initialize` ran (it reads the server at most once).
    initialized: bool = False

    #: Deepest nesting of arrays and objects the database's JSON takes, when lower
    #: than the toolkit's own :data:`~outbox_core.message.MAX_JSON_DEPTH` (None: that one).
    max_json_depth: int | None = None

    def json_depth_problem(self, name: str, text: str) -> str | None:
        """Why the JSON ``text`` of ``name`` is nested too deep for this database, or None."""
        limit = self.max_json_depth
        depth = json_depth(text, limit) if limit is not None else None
        if depth is None:
            return None
        return (
            f"{name} is nested {depth} deep (arrays and objects); this database's JSON "
            f"takes at most {limit}: flatten it"
        )

    def size_problem(self, event: NewEvent) -> str | None:
        """Why ``event`` is too large for this server, or None (see :meth:`initialize`)."""
        return None

    def check_event(self, event: NewEvent) -> None:
        """Raise :class:`PayloadError` when this database cannot store ``event``.

        Runs in ``enqueue`` before anything is written, so the caller's
        transaction stays usable (a refused statement aborts a PostgreSQL
        transaction).
        """
        for name, text in (("topic", event.topic), ("key", event.key)):
            problem = self.text_problem(name, text) if text is not None else None
            if problem:
                raise PayloadError(problem)
        for name, value, serialised in (
            ("payload", event.payload, event.payload_json),
            ("headers", event.headers, event.headers_json),
        ):
            if serialised and self.json_suspect(serialised):
                problem = self.json_problem(name, value)
                if problem:
                    raise PayloadError(problem)
            problem = self.json_depth_problem(name, serialised) if serialised else None
            if problem:
                raise PayloadError(problem)
        problem = self.size_problem(event)
        if problem:
            raise PayloadError(problem)
