"""What each database cannot store is refused at ``enqueue``, before anything is written.

The error is the toolkit's own (:class:`PayloadError` / :class:`EventError`),
names the field, and leaves the caller's transaction usable: on PostgreSQL a
refused statement would abort the whole business transaction.
"""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa

from outbox_core import EventError, Outbox, PayloadError


def _business_table(outbox: Outbox) -> sa.Table:
    table = sa.Table(
        f"{outbox.table.name}_biz",
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("note", sa.String(50)),
    )
    table.create(outbox.engine)
    return table


def _refused_then_usable(outbox: Outbox, payload: Any, error: type[Exception], text: str) -> None:
    biz = _business_table(outbox)
    try:
        with outbox.engine.begin() as conn:
            conn.execute(biz.insert().values(id=1, note="before"))
            with pytest.raises(error) as caught:
                outbox.enqueue(conn, "order.created", payload, key="order-1")
            assert text in str(caught.value)
            # The business transaction goes on and commits.
            conn.execute(biz.insert().values(id=2, note="after"))
            outbox.enqueue(conn, "order.created", {"ok": True}, key="order-1")
        with outbox.engine.connect() as conn:
            assert conn.execute(sa.select(sa.func.count()).select_from(biz)).scalar_one() == 2
            t = outbox.table
            assert conn.execute(sa.select(t.c.payload)).scalars().all() == [{"ok": True}]
    finally:
        biz.drop(outbox.engine)


def test_nul_is_refused_on_postgresql_and_stored_elsewhere(outbox: Outbox, backend: str) -> None:
    payload = {"lines": [{"note": "a\x00b"}]}
    if backend == "postgresql":
        _refused_then_usable(
            outbox, payload, PayloadError, "payload['lines'][0]['note'] contains a NUL character"
        )
        return
    with outbox.engine.begin() as conn:
        outbox.enqueue(conn, "t", payload)
    with outbox.engine.connect() as conn:
        assert conn.execute(sa.select(outbox.table.c.payload)).scalar_one() == payload


def test_a_nul_in_a_key_or_topic_is_refused_on_postgresql(outbox: Outbox, backend: str) -> None:
    if backend != "postgresql":
        pytest.skip("only PostgreSQL text refuses NUL")
    with outbox.engine.begin() as conn, pytest.raises(PayloadError, match="key contains a NUL"):
        outbox.enqueue(conn, "t", {}, key="k\x00")


def test_a_lone_surrogate_is_refused_everywhere(outbox: Outbox) -> None:
    _refused_then_usable(
        outbox,
        {"customer": {"name": "Zo\ud800e"}},
        PayloadError,
        "payload['customer']['name'] contains a lone surrogate",
    )


def test_a_lone_surrogate_in_a_header_is_refused(outbox: Outbox) -> None:
    with outbox.engine.begin() as conn, pytest.raises(PayloadError, match="headers"):
        outbox.enqueue(conn, "t", {}, headers={"x-note": "\udfff"})


def test_a_topic_is_limited_in_characters_not_in_amqp_bytes(outbox: Outbox) -> None:
    """The table holds 255 characters; the 255-byte routing key is RabbitMQ's rule, at publish."""
    loose = Outbox(outbox.engine, table=outbox.table.name, portable_topics=False)
    with outbox.engine.begin() as conn:
        with pytest.raises(EventError, match="topic is 256 characters long; the limit is 255"):
            loose.enqueue(conn, "t" * 256, {})
        loose.enqueue(conn, "з" * 200, {})  # 400 bytes of UTF-8: fine for non-AMQP brokers
    with outbox.engine.connect() as conn:
        assert conn.execute(sa.select(outbox.table.c.topic)).scalar_one() == "з" * 200


@pytest.mark.needs_server
def test_mariadb_stores_utf8_json_not_ascii_escapes(outbox: Outbox, backend: str) -> None:
    if backend != "mysql":
        pytest.skip("the escaping was MariaDB's (JSON is LONGTEXT there)")
    text = "Заказ оформлен" * 1000
    with outbox.engine.begin() as conn:
        outbox.enqueue(conn, "t", {"note": text})
    t = outbox.table
    with outbox.engine.connect() as conn:
        stored = conn.execute(sa.select(sa.cast(t.c.payload, sa.Text))).scalar_one()
        size = conn.execute(sa.select(sa.func.length(t.c.payload))).scalar_one()
        assert conn.execute(sa.select(t.c.payload)).scalar_one() == {"note": text}
    assert "\\u04" not in stored
    assert size < len(text.encode("utf-8")) + 100  # bytes: UTF-8, not six per character


@pytest.mark.needs_server
def test_mysql_payload_over_max_allowed_packet_is_refused_clearly(
    outbox: Outbox, backend: str
) -> None:
    if backend != "mysql":
        pytest.skip("max_allowed_packet is MySQL's and MariaDB's")
    with outbox.engine.connect() as conn:
        packet = int(conn.execute(sa.text("SELECT @@max_allowed_packet")).scalar_one())
    outbox.producer.max_payload_bytes = None  # the server's own limit, not the outbox's
    _refused_then_usable(
        outbox, {"text": "ж" * (packet // 2 + 1)}, PayloadError, "max_allowed_packet"
    )
    # 10 MB of Cyrillic fits once stored as UTF-8 (it was 60 MB of escapes).
    if packet > 12_000_000:
        with outbox.engine.begin() as conn:
            event_id = outbox.enqueue(conn, "t", {"text": "ж" * 5_000_000})
        t = outbox.table
        with outbox.engine.connect() as conn:
            size = conn.execute(
                sa.select(sa.func.length(t.c.payload)).where(t.c.event_id == event_id)
            ).scalar_one()
        assert 10_000_000 < size < 10_000_100
