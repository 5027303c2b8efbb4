"""What MySQL and MariaDB cannot store: packet size, DATETIME range, narrow character sets."""

from __future__ import annotations

from datetime import datetime
from typing import Any, ClassVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox_core.dialects.base import StorageRules
from outbox_core.dialects.mysql.session import is_mariadb
from outbox_core.message import NewEvent


class MysqlStorage(StorageRules):
    """MySQL / MariaDB storage rules; :meth:`initialize` reads the server's packet limit."""

    #: Payloads are stored as UTF-8 JSON text. SQLAlchemy's default serialiser
    #: writes ASCII with ``\\uXXXX`` escapes, which MariaDB (JSON = LONGTEXT)
    #: keeps as they are: three times the bytes for Cyrillic or CJK text.
    json_as_text: ClassVar[bool] = True
    #: ``@@max_allowed_packet`` of the server, read by :meth:`initialize`.
    max_packet: int | None = None
    #: Bytes of an enqueue INSERT besides payload and headers (columns, quoting), generously.
    INSERT_OVERHEAD: ClassVar[int] = 4096
    parses_json: ClassVar[bool] = True
    #: Bytes a MySQL TEXT column holds, by type.
    TEXT_BYTES: ClassVar[dict[str, int]] = {
        "TINYTEXT": 255,
        "TEXT": 65_535,
        "MEDIUMTEXT": 16_777_215,
        "LONGTEXT": 4_294_967_295,
    }
    #: Python codecs of the character sets that cannot store every character.
    NARROW_CHARSETS: ClassVar[dict[str, str]] = {
        "latin1": "cp1252",
        "ascii": "ascii",
        "utf8": "bmp",
        "utf8mb3": "bmp",
    }

    def text_storage(
        self, inspector: sa.Inspector, table: sa.Table, column_type: Any
    ) -> tuple[int | None, str | None]:
        """TEXT types hold bytes, not characters; latin1 and utf8mb3 hold fewer characters."""
        limit = self.TEXT_BYTES.get(type(column_type).__name__.upper())
        charset = getattr(column_type, "charset", None)
        if not charset:
            options = inspector.get_table_options(table.name, schema=table.schema)
            charset = options.get("mysql_default charset")
        codec = self.NARROW_CHARSETS.get(str(charset).lower()) if charset else None
        return limit, codec

    def time_problem(self, name: str, value: datetime) -> str | None:
        """DATETIME starts at 1000-01-01."""
        if value.year < 1000:
            return f"{name} {value.isoformat()} is before 1000-01-01 (MySQL DATETIME)"
        return None

    def time_digits(self, column_type: Any) -> int:
        """``DATETIME(fsp)``: 0 digits unless declared."""
        fsp = getattr(column_type, "fsp", None)
        return int(fsp) if fsp else 0

    #: The server is MariaDB (set by :meth:`initialize`; MySQL until then).
    mariadb: bool = False

    def initialize(self, conn: Connection) -> None:
        """MariaDB or MySQL, and ``@@max_allowed_packet`` (larger statements are refused)."""
        if self.initialized:
            return
        self.mariadb = is_mariadb(conn)
        # MariaDB's JSON_VALID (the column's CHECK) refuses 32 nested arrays or
        # objects; MySQL 8 takes 100, the toolkit's own limit.
        self.max_json_depth = 31 if self.mariadb else None
        self.max_packet = int(
            conn.execute(sa.select(sa.literal_column("@@max_allowed_packet"))).scalar_one()
        )
        self.initialized = True

    def size_problem(self, event: NewEvent) -> str | None:
        """The INSERT (payload, headers and the rest) must fit in ``max_allowed_packet``."""
        if self.max_packet is None:
            return None
        size = len(event.payload_json.encode("utf-8")) + len(
            (event.headers_json or "").encode("utf-8")
        )
        if size + self.INSERT_OVERHEAD <= self.max_packet:
            return None
        return (
            f"payload is {size:,} bytes as UTF-8 JSON; this server's max_allowed_packet is "
            f"{self.max_packet:,} bytes and the whole INSERT must fit in it: raise "
            "max_allowed_packet on the server, or store the body elsewhere and enqueue a "
            "reference to it"
        )
