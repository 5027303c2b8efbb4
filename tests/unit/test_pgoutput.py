"""The pgoutput (protocol version 1) decoder on hand-built bytes; the reader's offline helpers.

Every message kind, the three column kinds, malformed input (truncated,
trailing bytes, unknown kinds, bad markers, bad text) raising
``WalDecodeError``, and text values loaded by type oid through psycopg 3.
"""

from __future__ import annotations

import struct
import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from outbox_core.dialects.postgresql.wal import (
    Begin,
    Column,
    Commit,
    Delete,
    Insert,
    LogicalMessage,
    Origin,
    Other,
    Relation,
    Truncate,
    Type,
    Unchanged,
    Update,
    WalDecodeError,
    decode_message,
    format_lsn,
    load_row,
    load_text,
    masked_url,
    parse_lsn,
    replication_conninfo,
    validate_slot_name,
)
from outbox_core.dialects.postgresql.wal.names import quote_identifier
from outbox_core.errors import ConfigurationError, InvalidIdentifier

WHEN = datetime(2024, 5, 1, 12, 30, 15, 123456, tzinfo=UTC)
MICROS = (WHEN - datetime(2000, 1, 1, tzinfo=UTC)) // timedelta(microseconds=1)


def cstr(text: str) -> bytes:
    return text.encode() + b"\0"


def tuple_data(*values: str | bytes | None) -> bytes:
    """'t' for str, 'n' for None, the raw kind byte for bytes (b"u")."""
    out = struct.pack("!H", len(values))
    for value in values:
        if value is None:
            out += b"n"
        elif isinstance(value, bytes):
            out += value
        else:
            raw = value.encode()
            out += b"t" + struct.pack("!I", len(raw)) + raw
    return out


def one_text(raw: bytes, length: int | None = None) -> bytes:
    """A one-column insert of relation 1 whose text value is ``raw`` (its length may lie)."""
    size = len(raw) if length is None else length
    return (
        b"I"
        + struct.pack("!I", 1)
        + b"N"
        + struct.pack("!H", 1)
        + b"t"
        + struct.pack("!I", size)
        + raw
    )


BEGIN = b"B" + struct.pack("!QqI", 0x1_0000_0010, MICROS, 742)
COMMIT = b"C" + struct.pack("!BQQq", 0, 0x1_0000_0010, 0x1_0000_0040, MICROS)
RELATION = (
    b"R"
    + struct.pack("!I", 16384)
    + cstr("public")
    + cstr("outbox")
    + b"d"
    + struct.pack("!H", 3)
    + b"\x01" + cstr("id") + struct.pack("!Ii", 20, -1)
    + b"\x00" + cstr("payload") + struct.pack("!Ii", 3802, -1)
    + b"\x00" + cstr("topic") + struct.pack("!Ii", 1043, 104)
)  # fmt: skip
INSERT = b"I" + struct.pack("!I", 16384) + b"N" + tuple_data("7", '{"a": "é"}', None)


def test_begin() -> None:
    assert decode_message(BEGIN) == Begin(final_lsn=0x1_0000_0010, commit_time=WHEN, xid=742)


def test_commit() -> None:
    assert decode_message(COMMIT) == Commit(
        flags=0, commit_lsn=0x1_0000_0010, end_lsn=0x1_0000_0040, commit_time=WHEN
    )


def test_relation_with_columns_flags_types_and_typmod() -> None:
    rel = decode_message(RELATION)
    assert isinstance(rel, Relation)
    assert (rel.relid, rel.namespace, rel.name, rel.replica_identity) == (
        16384,
        "public",
        "outbox",
        "d",
    )
    assert rel.columns == (
        Column(1, "id", 20, -1),
        Column(0, "payload", 3802, -1),
        Column(0, "topic", 1043, 104),
    )
    assert [c.is_key for c in rel.columns] == [True, False, False]
    assert rel.type_oids == {"id": 20, "payload": 3802, "topic": 1043}


def test_relation_of_pg_catalog_has_an_empty_namespace() -> None:
    raw = b"R" + struct.pack("!I", 1) + cstr("") + cstr("t") + b"n" + struct.pack("!H", 0)
    rel = decode_message(raw)
    assert isinstance(rel, Relation)
    assert (rel.namespace, rel.schema, rel.columns) == ("", "pg_catalog", ())


def test_insert_with_text_and_null() -> None:
    assert decode_message(INSERT) == Insert(16384, ("7", '{"a": "é"}', None))


def test_relation_row_maps_names_and_checks_the_column_count() -> None:
    rel = decode_message(RELATION)
    ins = decode_message(INSERT)
    assert isinstance(rel, Relation) and isinstance(ins, Insert)
    assert rel.row(ins.new) == {"id": "7", "payload": '{"a": "é"}', "topic": None}
    with pytest.raises(WalDecodeError, match="2 columns"):
        rel.row(("1", "2"))


def test_update_without_old_tuple() -> None:
    raw = b"U" + struct.pack("!I", 5) + b"N" + tuple_data("1", b"u")
    assert decode_message(raw) == Update(5, None, None, ("1", Unchanged.TOAST))


@pytest.mark.parametrize("marker", ["K", "O"])
def test_update_with_old_key_or_row(marker: str) -> None:
    raw = (
        b"U" + struct.pack("!I", 5) + marker.encode() + tuple_data("1", None)
        + b"N" + tuple_data("2", "x")
    )  # fmt: skip
    assert decode_message(raw) == Update(5, marker, ("1", None), ("2", "x"))


@pytest.mark.parametrize("marker", ["K", "O"])
def test_delete(marker: str) -> None:
    raw = b"D" + struct.pack("!I", 9) + marker.encode() + tuple_data("3", None)
    assert decode_message(raw) == Delete(9, marker, ("3", None))


def test_truncate() -> None:
    msg = decode_message(b"T" + struct.pack("!IB", 2, 3) + struct.pack("!II", 10, 11))
    assert msg == Truncate(3, (10, 11))
    assert isinstance(msg, Truncate) and msg.cascade and msg.restart_identity


def test_type() -> None:
    raw = b"Y" + struct.pack("!I", 70000) + cstr("public") + cstr("mood")
    assert decode_message(raw) == Type(70000, "public", "mood")


def test_origin() -> None:
    raw = b"O" + struct.pack("!Q", 0xABCDEF) + cstr("node_a")
    assert decode_message(raw) == Origin(0xABCDEF, "node_a")


def test_logical_message() -> None:
    raw = b"M" + struct.pack("!BQ", 1, 77) + cstr("outbox") + struct.pack("!I", 3) + b"\x00hi"
    assert decode_message(raw) == LogicalMessage(True, 77, "outbox", b"\x00hi")


@pytest.mark.parametrize("kind", list("SEcAbPKrp"))
def test_kinds_of_later_protocol_versions_are_other(kind: str) -> None:
    raw = kind.encode() + b"\x00\x01whatever"
    assert decode_message(raw) == Other(kind, raw)


def test_memoryview_and_bytearray_input() -> None:
    assert decode_message(memoryview(BEGIN)) == decode_message(bytearray(BEGIN))


def test_empty_text_value_is_not_null() -> None:
    raw = b"I" + struct.pack("!I", 1) + b"N" + tuple_data("", None)
    assert decode_message(raw) == Insert(1, ("", None))


# ------------------------------------------------------------------ malformed input

MALFORMED = {
    "empty": b"",
    "unknown kind": b"Z\x00\x00",
    "begin truncated": BEGIN[:-1],
    "begin with trailing byte": BEGIN + b"\x00",
    "commit truncated": COMMIT[:10],
    "relation truncated in a column": RELATION[:-3],
    "relation name unterminated": b"R" + struct.pack("!I", 1) + b"public",
    "insert without N": b"I" + struct.pack("!I", 1) + b"X" + tuple_data("1"),
    "insert tuple missing a column": b"I" + struct.pack("!I", 1) + b"N" + tuple_data("1")[:-1],
    "insert text length past the end": one_text(b"abc", 99),
    "insert text length cut short": b"I" + struct.pack("!I", 1) + b"N" + tuple_data("abc")[:5],
    "insert column count cut short": b"I" + struct.pack("!I", 1) + b"N\x00",
    "insert column count says 2, one sent": (
        b"I" + struct.pack("!I", 1) + b"N" + struct.pack("!H", 2) + b"n"
    ),
    "unknown column kind": b"I" + struct.pack("!I", 1) + b"N" + tuple_data(b"x"),
    "binary column value": (
        b"I" + struct.pack("!I", 1) + b"N" + tuple_data(b"b" + struct.pack("!I", 1) + b"\x01")
    ),
    "text not utf-8": one_text(b"\xff"),
    "update old tuple without N": b"U" + struct.pack("!I", 1) + b"K" + tuple_data("1") + b"X",
    "update bad marker": b"U" + struct.pack("!I", 1) + b"Q" + tuple_data("1"),
    "delete bad marker": b"D" + struct.pack("!I", 1) + b"N" + tuple_data("1"),
    "truncate fewer relids than counted": b"T" + struct.pack("!IBI", 2, 0, 10),
    "message content cut short": b"M" + struct.pack("!BQ", 0, 1) + cstr("p") + b"\x00\x00\x00\x05x",
    "origin name unterminated": b"O" + struct.pack("!Q", 1) + b"abc",
    "type cut in the oid": b"Y\x00\x01",
}


@pytest.mark.parametrize("raw", list(MALFORMED.values()), ids=list(MALFORMED))
def test_malformed_input_raises_wal_decode_error(raw: bytes) -> None:
    with pytest.raises(WalDecodeError):
        decode_message(raw)


def test_decode_error_is_a_value_error_with_a_clear_message() -> None:
    with pytest.raises(ValueError, match=r"truncated 'B' message: 20 more bytes"):
        decode_message(b"B" + b"\x00" * 4)


def test_a_commit_time_out_of_range_is_a_decode_error() -> None:
    raw = b"B" + struct.pack("!QqI", 1, 2**62, 1)
    with pytest.raises(WalDecodeError, match="out of range"):
        decode_message(raw)


# ------------------------------------------------------------------ values by type oid

LOADED = [
    ("9000000000", 20, 9_000_000_000),  # int8
    ("-7", 23, -7),  # int4
    ("12", 21, 12),  # int2 / smallint
    ("héllo", 25, "héllo"),  # text
    ("topic", 1043, "topic"),  # varchar
    (
        "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",
        2950,
        uuid.UUID("a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"),
    ),
    ('{"a": [1, null], "b": "é"}', 3802, {"a": [1, None], "b": "é"}),  # jsonb
    ('{"a":1}', 114, {"a": 1}),  # json
    ("2024-05-01 14:30:15.123456+02", 1184, WHEN),  # timestamptz
    ("2024-05-01 12:30:15.123456", 1114, WHEN.replace(tzinfo=None)),  # timestamp
    ("\\x00ff10", 17, b"\x00\xff\x10"),  # bytea, hex output
    ("t", 16, True),
    ("f", 16, False),
    ("1.50", 1700, Decimal("1.50")),  # numeric: psycopg's loader too
    ("anything", 987654, "anything"),  # an oid psycopg does not know: text
]


@pytest.mark.parametrize(("text", "oid", "expected"), LOADED)
def test_load_text_by_type_oid(text: str, oid: int, expected: object) -> None:
    value = load_text(text, oid)
    assert value == expected
    assert type(value) is type(expected)


def test_load_text_null_and_unchanged_toast() -> None:
    assert load_text(None, 20) is None
    with pytest.raises(WalDecodeError, match="TOAST"):
        load_text(Unchanged.TOAST, 25)


def test_load_text_garbage_is_a_decode_error() -> None:
    with pytest.raises(WalDecodeError, match="oid 20"):
        load_text("twelve", 20)


def test_load_row() -> None:
    assert load_row({"id": "1", "p": None}, {"id": 20, "p": 3802}) == {"id": 1, "p": None}


# ------------------------------------------------------------------ stream.py's offline helpers


def test_lsn_round_trip() -> None:
    assert parse_lsn("16/B374D848") == (0x16 << 32) | 0xB374D848
    assert format_lsn((0x16 << 32) | 0xB374D848) == "16/B374D848"
    assert format_lsn(0) == "0/0"
    for bad in ("", "16", "x/y", "1/2/3"):
        with pytest.raises(ConfigurationError):
            parse_lsn(bad)


def test_slot_names_follow_postgresql_rules() -> None:
    assert validate_slot_name("outbox_wal_1") == "outbox_wal_1"
    for bad in ("Outbox", "a-b", "", "x" * 64, 'a"b'):
        with pytest.raises(ConfigurationError):
            validate_slot_name(bad)


def test_identifiers_are_validated_and_quoted() -> None:
    assert quote_identifier("Outbox_1", "table name") == '"Outbox_1"'
    with pytest.raises(InvalidIdentifier):
        quote_identifier('x"; DROP TABLE y; --', "table name")


def test_conninfo_from_a_sqlalchemy_url_keeps_the_query_and_never_shows_the_password() -> None:
    url = "postgresql+psycopg://app:s3cr%40t@db.example:6432/shop?sslmode=require"
    args = replication_conninfo(url, wal_sender_timeout=10)
    assert args["host"] == "db.example" and args["port"] == "6432"
    assert (args["user"], args["password"], args["dbname"]) == ("app", "s3cr@t", "shop")
    assert args["sslmode"] == "require" and args["client_encoding"] == "UTF8"
    assert "-c wal_sender_timeout=10000ms" in args["options"]
    assert "-c datestyle=ISO" in args["options"]
    assert masked_url(url) == "postgresql+psycopg://app:***@db.example:6432/shop?sslmode=require"


def test_conninfo_refuses_another_database() -> None:
    with pytest.raises(ConfigurationError, match=r"\*\*\*") as info:
        replication_conninfo("mysql+pymysql://root:hunter2@h/db")
    assert "hunter2" not in str(info.value)


def test_conninfo_merges_options_of_the_url() -> None:
    args = replication_conninfo("postgresql://u@h/d?options=-c%20search_path%3Dx")
    assert args["options"].startswith("-c search_path=x -c datestyle=ISO")
