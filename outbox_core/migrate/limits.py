"""What the target table can store, asked of the target's dialect and its reflected columns."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox_core.dialects.base import Dialect, get_dialect
from outbox_core.errors import PayloadError
from outbox_core.jsoncheck import check_json, dump_json
from outbox_core.message import NewEvent
from outbox_core.migrate.model import SOURCE_COLUMNS, MigrationRefused, SourceEvent
from outbox_core.schema import OutboxTables


@dataclass(frozen=True)
class TargetLimits:
    """What the target table can store, from its reflected columns.

    ``problem(event)`` names the first value of an event the target would
    refuse or mangle, before anything of the batch is written.
    """

    backend: str
    #: The target's storage rules (what text it refuses, how large a statement may be);
    #: by default the backend's dialect, without the server's limits.
    dialect: Dialect = None  # type: ignore[assignment]  # set in __post_init__
    #: Longest value in characters per text column (None: unlimited).
    chars: dict[str, int | None] = field(default_factory=dict)
    #: Longest value in bytes per text column (MySQL TEXT types).
    max_bytes: dict[str, int] = field(default_factory=dict)
    #: Python codec per text column whose MySQL character set is narrower than UTF-8.
    codecs: dict[str, str] = field(default_factory=dict)
    #: The target stores ``event_id`` as a native UUID.
    uuid_event_id: bool = False

    def __post_init__(self) -> None:
        if self.dialect is None:  # frozen: set the default the way dataclasses do
            object.__setattr__(
                self, "dialect", get_dialect(self.backend)(OutboxTables.create("outbox"))
            )

    @classmethod
    def reflect(cls, conn: Connection, table: sa.Table, dialect: Dialect) -> TargetLimits:
        """Read the limits of ``table`` on ``conn`` (which must exist)."""
        dialect.storage.initialize(conn)
        inspector = sa.inspect(conn)
        columns = {c["name"]: c for c in inspector.get_columns(table.name, schema=table.schema)}
        missing = [c for c in SOURCE_COLUMNS if c not in columns]
        if missing:
            raise MigrationRefused(
                f"target table {table.fullname!r} has no column(s) {', '.join(missing)}: it is "
                "not an outbox table of this version; create it with `outbox install`"
            )
        chars: dict[str, int | None] = {}
        max_bytes: dict[str, int] = {}
        codecs: dict[str, str] = {}
        for name in ("event_id", "topic", "key", "last_error"):
            col_type = columns[name]["type"]
            if dialect.storage.enforces_lengths:
                length = getattr(col_type, "length", None)
                chars[name] = length if isinstance(length, int) else None
            byte_limit, codec = dialect.storage.text_storage(inspector, table, col_type)
            if byte_limit is not None:
                max_bytes[name] = byte_limit
            if codec:
                codecs[name] = codec
        uuid_id = isinstance(columns["event_id"]["type"], sa.Uuid) or (
            type(columns["event_id"]["type"]).__name__.upper() in ("UUID", "UNIQUEIDENTIFIER")
        )
        return cls(dialect.name, dialect, chars, max_bytes, codecs, uuid_id)

    def problem(self, event: SourceEvent) -> str | None:
        """Why the target cannot store ``event`` exactly, or None when it can."""
        if self.uuid_event_id:
            try:
                uuid.UUID(event.event_id)
            except ValueError:
                return f"event_id {event.event_id!r} is not a UUID (the target column is uuid)"
        for name in ("event_id", "topic", "key", "last_error"):
            value = getattr(event, name)
            if value is not None:
                found = self._text_problem(name, value)
                if found:
                    return found
        for name in ("payload", "headers"):
            found = self._json_problem(name, getattr(event, name))
            if found:
                return found
        try:
            sized = NewEvent(
                event.event_id,
                event.topic,
                event.payload,
                payload_json=dump_json(event.payload),
                headers_json=None if event.headers is None else dump_json(event.headers),
            )
        except (TypeError, ValueError, RecursionError):
            return "payload cannot be written as JSON"
        found = self.dialect.storage.size_problem(sized)
        if found:
            return found
        for name in ("available_at", "created_at", "sent_at"):
            value = getattr(event, name)
            found = self.dialect.storage.time_problem(name, value) if value is not None else None
            if found:
                return found
        return None

    def _text_problem(self, name: str, value: str) -> str | None:
        found = self.dialect.storage.text_problem(name, value)
        if found:
            return found
        encoded = value.encode("utf-8")
        limit = self.chars.get(name)
        length = self.dialect.storage.text_length(value)
        if limit is not None and length > limit:
            return (
                f"{name} is {length} characters long; the target column holds {limit} "
                "(widen it on the target)"
            )
        byte_limit = self.max_bytes.get(name)
        if byte_limit is not None and len(encoded) > byte_limit:
            return f"{name} is {len(encoded)} bytes long; the target column holds {byte_limit}"
        codec = self.codecs.get(name)
        if codec is not None:
            bad = _unencodable(value, codec)
            if bad is not None:
                charset = "utf8mb3" if codec == "bmp" else codec
                return (
                    f"{name} contains {bad!r}, which the target column's character set "
                    f"({charset}) cannot store (convert the table to utf8mb4)"
                )
        return None

    def _json_problem(self, name: str, value: Any) -> str | None:
        # SQLAlchemy writes JSON as ASCII text: SQLite and SQL Server (NVARCHAR) take
        # any of it; PostgreSQL's jsonb and MySQL's JSON parse it and can refuse.
        if value is None or not self.dialect.storage.parses_json:
            return None
        try:
            text = check_json(value, name)  # not JSON, too deep, a lone surrogate: named
        except PayloadError as exc:
            return str(exc)
        storage = self.dialect.storage
        found = storage.json_problem(name, value) if storage.json_suspect(text) else None
        return found or storage.json_depth_problem(name, text)


def _unencodable(value: str, codec: str) -> str | None:
    if codec == "bmp":
        return next((ch for ch in value if ord(ch) > 0xFFFF), None)
    try:
        value.encode(codec)
    except UnicodeEncodeError as exc:
        return value[exc.start]
    return None
