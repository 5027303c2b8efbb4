"""The dialect contract: written once, run on every reachable database.

Each test names the guarantee it checks; ``backend`` parametrises it over
SQLite, PostgreSQL, MariaDB/MySQL and (where configured) SQL Server.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from outbox_core import (
    EventError,
    InvalidIdentifier,
    Outbox,
    Outcome,
    PayloadError,
    State,
    UnknownBroker,
    UnknownDialect,
)
from outbox_core.brokers.memory import MemoryBroker, MemoryQueue
from outbox_core.message import Event, Failure
from outbox_core.relay import OnCycle
from outbox_core.schema import detached_index, obsolete_indexes
from tests.conftest import async_url
from tests.support import set_lock_timeout

LEASE = 30.0


def enqueue_many(outbox: Outbox, n: int, *, key: str | None = None, topic: str = "t") -> list[str]:
    with outbox.engine.begin() as conn:
        return [outbox.enqueue(conn, topic, {"n": i}, key=key) for i in range(n)]


def rows(outbox: Outbox) -> list[sa.Row[Any]]:
    t = outbox.table
    with outbox.engine.connect() as conn:
        return list(conn.execute(sa.select(t).order_by(t.c.id)))


def by_state(outbox: Outbox) -> dict[int, int]:
    counts: dict[int, int] = {}
    for r in rows(outbox):
        counts[r.state] = counts.get(r.state, 0) + 1
    return counts


def make_due(outbox: Outbox) -> None:
    """Skip the backoff: every row is due now."""
    t = outbox.table
    with outbox.engine.begin() as conn:
        conn.execute(sa.update(t).values(available_at=t.c.created_at))


@contextmanager
def connection(outbox: Outbox) -> Iterator[sa.Connection]:
    conn = outbox.engine.connect()
    try:
        yield conn
    finally:
        conn.close()


def claim(outbox: Outbox, conn: sa.Connection, token: str, **kw: Any) -> list[Event]:
    args: dict[str, Any] = {"limit": 10, "lease": LEASE, "ordered": False}
    args.update(kw)
    return outbox.dialect.claim(conn, token=token, **args)


# -- atomic with the business transaction -----------------------------------------


def test_committed_event_is_claimable_rolled_back_never(outbox: Outbox) -> None:
    with outbox.engine.begin() as conn:
        committed = outbox.enqueue(conn, "order.created", {"id": 1}, key="order-1")
    with pytest.raises(RuntimeError), outbox.engine.begin() as conn:
        outbox.enqueue(conn, "order.created", {"id": 2}, key="order-2")
        raise RuntimeError("business rule failed")
    with connection(outbox) as conn:
        claimed = claim(outbox, conn, "relay-a")
        assert [e.event_id for e in claimed] == [committed]
        assert claimed[0].payload == {"id": 1}
        assert claimed[0].key == "order-1"
        assert claimed[0].attempts == 1
        assert claim(outbox, conn, "relay-b") == []
    assert len(rows(outbox)) == 1


def test_enqueue_never_commits_the_callers_transaction(outbox: Outbox) -> None:
    with outbox.engine.connect() as conn:
        outbox.enqueue(conn, "t", {"a": 1})
        assert conn.in_transaction()
        conn.rollback()
    assert rows(outbox) == []


def test_enqueue_with_a_session(outbox: Outbox) -> None:
    with Session(outbox.engine) as session:
        event_id = outbox.enqueue(session, "t", {"a": 1}, headers={"traceparent": "00-x"})
        session.rollback()
        outbox.enqueue(session, "t", {"b": 2})
        session.commit()
    [row] = rows(outbox)
    assert row.payload == {"b": 2}
    assert str(row.event_id) != event_id


def test_enqueue_many_keeps_the_given_order_and_commits_with_the_caller(outbox: Outbox) -> None:
    events = [
        {"topic": "order.line", "payload": {"n": i, "name": f"caf\u00e9 {i}"}, "key": f"k{i % 3}"}
        for i in range(2500)  # more than one multi-row INSERT
    ]
    events[7]["headers"] = {"tenant": "acme"}
    events[8]["key"] = None
    with pytest.raises(RuntimeError), outbox.engine.begin() as conn:
        outbox.enqueue_many(conn, events)
        raise RuntimeError("business rule failed")
    assert rows(outbox) == []
    with outbox.engine.begin() as conn:
        ids = outbox.enqueue_many(conn, events)
        assert outbox.enqueue_many(conn, []) == []
    assert len(set(ids)) == 2500
    stored = sorted(rows(outbox), key=lambda r: r.id)
    assert [str(r.event_id) for r in stored] == ids  # ids follow the order given
    assert [r.payload for r in stored] == [e["payload"] for e in events]
    assert stored[7].headers == {"tenant": "acme"} and stored[8].key is None
    assert stored[0].headers is None  # SQL NULL, not JSON null
    with connection(outbox) as conn:
        claimed = outbox.dialect.claim(conn, limit=10, lease=30, token="r", ordered=True)
    assert [e.payload["n"] for e in claimed] == [0, 1, 2, 8]  # each key's head, and the keyless


def test_enqueue_many_checks_every_event_before_writing_any(outbox: Outbox) -> None:
    good = {"topic": "t", "payload": {"ok": 1}}
    with outbox.engine.begin() as conn:
        with pytest.raises(PayloadError, match=r"events\[2\]: payload\['when'\]"):
            outbox.enqueue_many(conn, [good, good, {"topic": "t", "payload": {"when": object()}}])
        with pytest.raises(EventError, match=r"events\[1\]: unknown colour; missing payload"):
            outbox.enqueue_many(conn, [good, {"topic": "t", "colour": "red"}])
        with pytest.raises(EventError, match=r"events\[0\]: each event is a mapping"):
            outbox.enqueue_many(conn, [("t", {})])  # type: ignore[list-item]
    assert rows(outbox) == []


def test_enqueue_many_delay_and_wake_up(outbox: Outbox) -> None:
    with outbox.engine.begin() as conn:
        outbox.enqueue_many(
            conn, [{"topic": "t", "payload": 1, "delay": 3600}, {"topic": "t", "payload": 2}]
        )
    with connection(outbox) as conn:
        claimed = outbox.dialect.claim(conn, limit=10, lease=30, token="r", ordered=False)
    assert [e.payload for e in claimed] == [2]  # the delayed one is not due yet


def test_enqueue_async(backend: str, outbox: Outbox, db_url: str) -> None:
    url = async_url(backend, db_url)
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    async def scenario() -> list[str]:
        engine = create_async_engine(url)
        ids = []
        try:
            async with engine.begin() as conn:
                ids.append(await outbox.enqueue_async(conn, "t", {"via": "conn"}, key="k"))
            async with AsyncSession(engine) as session:
                ids.append(await outbox.enqueue_async(session, "t", {"via": "session"}))
                await session.commit()
            async with AsyncSession(engine) as session:
                await outbox.enqueue_async(session, "t", {"via": "rolled back"})
                await session.rollback()
        finally:
            await engine.dispose()
        return ids

    ids = asyncio.run(scenario())
    assert [str(r.event_id) for r in rows(outbox)] == ids


def test_enqueue_async_wakes_in_process_relays_at_commit_like_enqueue(
    backend: str, outbox: Outbox, db_url: str
) -> None:
    """enqueue_async once skipped the after-commit wake-up that enqueue does."""
    url = async_url(backend, db_url)
    from sqlalchemy.ext.asyncio import create_async_engine

    relay, _ = _relay(outbox)
    woken: list[bool] = []

    async def scenario() -> None:
        engine = create_async_engine(url)
        try:
            async with engine.begin() as conn:
                await outbox.enqueue_async(conn, "t", {"n": 1})
                await outbox.enqueue_async(conn, "t", {"n": 2})
                woken.append(relay.control.woken)  # not before the commit
            woken.append(relay.control.woken)
        finally:
            await engine.dispose()

    asyncio.run(scenario())
    relay.close()
    assert woken == [False, True]


# -- exclusive claims -----------------------------------------------------------------


@pytest.mark.alone  # it times a lock wait
def test_two_relays_claim_disjoint_rows_without_waiting(backend: str, outbox: Outbox) -> None:
    enqueue_many(outbox, 10)
    with connection(outbox) as a, connection(outbox) as b:
        if not outbox.dialect.row_locks:
            # SQLite: writers take turns, so claims are serial; still disjoint.
            first = claim(outbox, a, "a", limit=4)
            second = claim(outbox, b, "b", limit=10)
        else:
            set_lock_timeout(b, backend, 2)
            outbox.dialect.session.prepare(a)
            a.begin()  # hold relay A's claim open: its rows stay locked
            first = claim(outbox, a, "a", limit=4)
            started = time.monotonic()
            second = claim(outbox, b, "b", limit=10)
            waited = time.monotonic() - started
            a.commit()
            assert waited < 1.5, f"relay B waited {waited:.2f}s on relay A's locks"
        assert len(first) == 4
        assert len(second) == 6
        assert {e.id for e in first}.isdisjoint({e.id for e in second})
    assert by_state(outbox) == {int(State.LEASED): 10}


def test_claim_never_exceeds_the_limit_and_returns_oldest_first(outbox: Outbox) -> None:
    enqueue_many(outbox, 25)
    with connection(outbox) as conn:
        batch = claim(outbox, conn, "a", limit=7)
    ids = [e.id for e in batch]
    assert len(ids) == 7
    assert ids == sorted(ids)
    assert ids == [r.id for r in rows(outbox)][:7]


def test_delayed_event_is_not_claimed_before_its_time(outbox: Outbox) -> None:
    with outbox.engine.begin() as conn:
        outbox.enqueue(conn, "later", {}, delay=3600)
        now_id = outbox.enqueue(conn, "now", {})
    with connection(outbox) as conn:
        assert [e.event_id for e in claim(outbox, conn, "a")] == [now_id]


def test_expired_lease_is_claimed_again_and_stale_writes_change_nothing(outbox: Outbox) -> None:
    enqueue_many(outbox, 1)
    with connection(outbox) as a, connection(outbox) as b:
        [stale] = claim(outbox, a, "relay-a", lease=0.2)
        time.sleep(0.5)
        assert claim(outbox, b, "relay-b") == []  # still leased until reaped
        assert outbox.dialect.reap(b, max_attempts=10) == 1
        [fresh] = claim(outbox, b, "relay-b")
        assert fresh.id == stale.id
        assert fresh.attempts == 2
        d = outbox.dialect
        assert d.mark_sent(a, [stale.id], token="relay-a", delete=False) == 0
        assert d.mark_failed(a, [Failure(stale.id, "late", 0.0)], token="relay-a") == 0
        assert d.release(a, [stale.id], token="relay-a") == 0
        assert d.mark_sent(a, [stale.id], token="relay-a", delete=True) == 0
        assert d.mark_sent(b, [fresh.id], token="relay-b", delete=False) == 1
    [row] = rows(outbox)
    assert row.state == State.SENT
    assert row.sent_at is not None
    assert row.lease_owner is None


def test_expired_but_unclaimed_lease_can_still_be_settled_by_its_owner(outbox: Outbox) -> None:
    enqueue_many(outbox, 1)
    with connection(outbox) as conn:
        [event] = claim(outbox, conn, "slow", lease=0.1)
        time.sleep(0.3)
        assert outbox.dialect.reap(conn, max_attempts=10) == 1
        # Nobody re-claimed it: the slow relay's publish counts, no duplicate.
        assert outbox.dialect.mark_sent(conn, [event.id], token="slow", delete=False) == 1
    assert by_state(outbox) == {int(State.SENT): 1}


def test_reap_makes_an_event_dead_once_its_attempts_are_spent(outbox: Outbox) -> None:
    enqueue_many(outbox, 1)
    with connection(outbox) as conn:
        for attempt in range(1, 4):
            [event] = claim(outbox, conn, f"crash-{attempt}", lease=0.05)
            assert event.attempts == attempt
            time.sleep(0.15)
            assert outbox.dialect.reap(conn, max_attempts=3) == 1
    [row] = rows(outbox)
    assert row.state == State.DEAD
    assert "lease expired" in row.last_error


# -- retries, dead events -----------------------------------------------------------------


def _relay(outbox: Outbox, decide: Any = None, **knobs: Any) -> tuple[Any, MemoryQueue]:
    queue = MemoryQueue("test")
    defaults: dict[str, Any] = {"reap_interval": 0, "cleanup_after": 0}
    defaults.update(knobs)
    return outbox.relay(MemoryBroker(queue, decide=decide), **defaults), queue


def test_transient_failure_backs_off_then_dead_after_max_attempts(outbox: Outbox) -> None:
    enqueue_many(outbox, 1)
    relay, queue = _relay(
        outbox, lambda e: Outcome.retry("broker said 503"), max_attempts=3, backoff_base=60
    )
    result = relay.run_once()
    assert (result.claimed, result.retried, result.dead) == (1, 1, 0)
    [row] = rows(outbox)
    assert row.state == State.PENDING
    assert row.last_error == "broker said 503"
    available = row.available_at.replace(tzinfo=None)
    created = row.created_at.replace(tzinfo=None)
    assert (available - created).total_seconds() >= 25  # 60s, jittered down to at most half
    assert relay.run_once().claimed == 0  # not due yet
    make_due(outbox)
    relay2, _ = _relay(outbox, lambda e: Outcome.retry("still 503"), max_attempts=3, backoff_base=0)
    relay2.run_once()
    relay2.run_once()
    [row] = rows(outbox)
    assert row.state == State.DEAD
    assert row.attempts == 3
    assert row.last_error == "still 503"
    assert relay2.run_once().claimed == 0
    assert queue.snapshot() == []
    relay.close()
    relay2.close()


def test_reject_is_dead_at_once_with_its_error(outbox: Outbox) -> None:
    enqueue_many(outbox, 2)
    first_id = rows(outbox)[0].id
    rejecting = {first_id}
    relay, queue = _relay(
        outbox, lambda e: Outcome.reject("no queue bound") if e.id in rejecting else None
    )
    result = relay.run_once()
    assert (result.sent, result.dead) == (1, 1)
    states = {r.id: (r.state, r.attempts, r.last_error) for r in rows(outbox)}
    assert states[first_id] == (State.DEAD, 1, "no queue bound")
    assert len(queue.snapshot()) == 1
    assert outbox.status().dead[0].last_error == "no queue bound"
    rejecting.clear()
    assert outbox.replay(topic="t") == 1
    assert relay.run_once().sent == 1  # the replayed event is due at once
    relay.close()


def test_replay_returns_dead_events_to_pending(outbox: Outbox) -> None:
    enqueue_many(outbox, 3)
    relay, _ = _relay(outbox, lambda e: Outcome.reject("bad"))
    relay.run_once()
    assert by_state(outbox) == {int(State.DEAD): 3}
    first = rows(outbox)[0].id
    assert outbox.replay(ids=[first]) == 1
    assert outbox.replay(all=True) == 2
    assert by_state(outbox) == {int(State.PENDING): 3}
    assert all(r.attempts == 0 for r in rows(outbox))
    relay.close()


# -- ordered mode ------------------------------------------------------------------------------


def test_ordered_head_of_key_blocks_the_next_event_of_its_key(outbox: Outbox) -> None:
    with outbox.engine.begin() as conn:
        k1 = [outbox.enqueue(conn, "t", {"i": i}, key="k1") for i in range(3)]
        k2 = [outbox.enqueue(conn, "t", {"i": i}, key="k2") for i in range(2)]
        free = outbox.enqueue(conn, "t", {"free": True})
    with connection(outbox) as a, connection(outbox) as b:
        first = claim(outbox, a, "a", ordered=True, limit=1)
        assert [e.event_id for e in first] == [k1[0]]
        # k1's head is leased: B gets k2's head and the keyless event, never k1[1].
        second = claim(outbox, b, "b", ordered=True)
        assert {e.event_id for e in second} == {k2[0], free}
        assert claim(outbox, b, "b2", ordered=True) == []
        outbox.dialect.mark_sent(a, [first[0].id], token="a", delete=False)
        third = claim(outbox, b, "b3", ordered=True)
        assert [e.event_id for e in third] == [k1[1]]


def test_ordered_head_in_an_open_claim_still_blocks_its_key(backend: str, outbox: Outbox) -> None:
    if not outbox.dialect.row_locks:
        pytest.skip("SQLite claims are serial: no claim can be open during another")
    with outbox.engine.begin() as conn:
        k = [outbox.enqueue(conn, "t", {"i": i}, key="k") for i in range(2)]
    with connection(outbox) as a, connection(outbox) as b:
        set_lock_timeout(b, backend, 2)
        outbox.dialect.session.prepare(a)
        a.begin()
        assert [e.event_id for e in claim(outbox, a, "a", ordered=True)] == [k[0]]
        # The head is locked and not yet committed as leased; SKIP LOCKED skips
        # it, but the plain head-of-key read still sees it pending.
        assert claim(outbox, b, "b", ordered=True) == []
        a.commit()


def test_ordered_dead_head_blocks_its_key_unless_told_otherwise(
    db_url: str, outbox: Outbox
) -> None:
    with outbox.engine.begin() as conn:
        k = [outbox.enqueue(conn, "t", {"i": i}, key="k") for i in range(2)]
    relay, queue = _relay(outbox, lambda e: Outcome.reject("poison"), ordered=True)
    relay.run_once()
    relay.close()
    with connection(outbox) as conn:
        assert claim(outbox, conn, "a", ordered=True) == []
    with connection(outbox) as conn:
        skipping = claim(outbox, conn, "b", ordered=True, block_on_dead=False)
        assert [e.event_id for e in skipping] == [k[1]]
    assert queue.snapshot() == []


def test_ordered_relays_deliver_each_key_in_order(outbox: Outbox) -> None:
    with outbox.engine.begin() as conn:
        for i in range(30):
            outbox.enqueue(conn, "t", {"i": i}, key=f"k{i % 3}")
    queue = MemoryQueue("ordered")
    relays = [
        outbox.relay(MemoryBroker(queue), ordered=True, batch_size=2, reap_interval=0)
        for _ in range(3)
    ]
    for _ in range(40):
        if not sum(r.run_once().claimed for r in relays):
            break
    delivered = queue.snapshot()
    assert len(delivered) == 30
    for key in ("k0", "k1", "k2"):
        seq = [e.payload["i"] for e in delivered if e.key == key]
        assert seq == sorted(seq)
    for r in relays:
        r.close()


# -- release, cleanup ------------------------------------------------------------------------------


def test_release_returns_unpublished_claims_without_burning_an_attempt(outbox: Outbox) -> None:
    enqueue_many(outbox, 3)
    with connection(outbox) as conn:
        claimed = claim(outbox, conn, "shutting-down")
        assert outbox.dialect.release(conn, [e.id for e in claimed], token="shutting-down") == 3
        again = claim(outbox, conn, "next")
    assert [e.id for e in again] == [e.id for e in claimed]
    assert all(e.attempts == 1 for e in again)


def test_cleanup_removes_only_old_sent_rows_in_batches(outbox: Outbox) -> None:
    enqueue_many(outbox, 9)
    d = outbox.dialect
    with connection(outbox) as conn:
        claimed = claim(outbox, conn, "a", limit=7)
        ids = [e.id for e in claimed]
        d.mark_sent(conn, ids[:5], token="a", delete=False)
        d.mark_failed(conn, [Failure(ids[5], "poison", None)], token="a")  # dead
        # ids[6] stays leased, two rows stay pending
        time.sleep(0.05)
        assert d.cleanup(conn, older_than=3600, batch=2) == 0  # none old enough
        assert d.cleanup(conn, older_than=0, batch=2) == 2
        assert d.cleanup(conn, older_than=0, batch=2) == 2
        assert d.cleanup(conn, older_than=0, batch=2) == 1
        assert d.cleanup(conn, older_than=0, batch=2) == 0
    assert by_state(outbox) == {
        int(State.DEAD): 1,
        int(State.LEASED): 1,
        int(State.PENDING): 2,
    }
    assert outbox.cleanup(older_than=0) == 0


def test_delete_on_send_removes_the_row(outbox: Outbox) -> None:
    enqueue_many(outbox, 3)
    relay, queue = _relay(outbox, delete_on_send=True)
    assert relay.run_once().sent == 3
    assert rows(outbox) == []
    assert len(queue.snapshot()) == 3
    relay.close()


def test_status_reports_counts_age_and_dead_topics(outbox: Outbox) -> None:
    enqueue_many(outbox, 2, topic="a")
    enqueue_many(outbox, 1, topic="b")
    relay, _ = _relay(outbox, lambda e: Outcome.reject("nope") if e.topic == "b" else None)
    relay.run_once()
    relay.close()
    status = outbox.status()
    assert status.counts == {"pending": 0, "leased": 0, "sent": 2, "dead": 1}
    assert status.oldest_pending_age is None
    assert [(d.topic, d.count, d.last_error) for d in status.dead] == [("b", 1, "nope")]
    enqueue_many(outbox, 1)
    age = outbox.status().oldest_pending_age
    assert age is not None
    assert 0 <= age < 60


# -- bad input --------------------------------------------------------------------------------


def test_unserialisable_payload_names_the_field_and_writes_nothing(outbox: Outbox) -> None:
    with outbox.engine.begin() as conn:
        with pytest.raises(PayloadError, match=r"payload\['lines'\]\[1\]\['price'\].*Decimal"):
            outbox.enqueue(conn, "t", {"lines": [{"price": 1}, {"price": Decimal("9.99")}]})
        with pytest.raises(PayloadError, match=r"payload\['at'\].*datetime"):
            outbox.enqueue(conn, "t", {"at": datetime.now(UTC)})
        with pytest.raises(PayloadError, match=r"headers\['x'\]"):
            outbox.enqueue(conn, "t", {}, headers={"x": 1})  # type: ignore[dict-item]
        with pytest.raises(EventError, match="topic"):
            outbox.enqueue(conn, "", {})
        with pytest.raises(EventError, match="topic"):
            outbox.enqueue(conn, "t" * 256, {})
        with pytest.raises(EventError, match="key"):
            outbox.enqueue(conn, "t", {}, key="k" * 256)
        with pytest.raises(EventError, match="delay"):
            outbox.enqueue(conn, "t", {}, delay=-1)
    assert rows(outbox) == []


def test_configuration_errors_are_named(db_url: str) -> None:
    with pytest.raises(InvalidIdentifier, match="x; drop table y"):
        Outbox(db_url, table="x; drop table y")
    with pytest.raises(InvalidIdentifier, match="schema"):
        Outbox(db_url, schema="a.b")
    with pytest.raises(UnknownDialect, match="mssql, mysql, postgresql, sqlite"):
        Outbox("oracle://scott:tiger@localhost/x")
    with pytest.raises(UnknownBroker, match=r"amqp://.*memory://"):
        Outbox(db_url).relay("sqs://localhost:9324")


# -- ordered runs ------------------------------------------------------------------------


def test_ordered_runs_go_in_order_and_stop_a_key_at_its_first_failure(outbox: Outbox) -> None:
    with outbox.engine.begin() as conn:
        k = [outbox.enqueue(conn, "t", {"i": i}, key="k") for i in range(4)]
        j = [outbox.enqueue(conn, "t", {"i": i}, key="j") for i in range(2)]
    failing = {k[1]}
    relay, queue = _relay(
        outbox,
        lambda e: Outcome.retry("503") if e.event_id in failing else None,
        ordered=True,
        run_length=3,
        backoff_base=60,
    )
    result = relay.run_once()
    relay.close()
    assert (result.claimed, result.sent, result.retried, result.released) == (5, 3, 1, 1)
    assert [e.event_id for e in queue.snapshot() if e.key == "k"] == [k[0]]
    assert [e.event_id for e in queue.snapshot() if e.key == "j"] == j
    state = {str(r.event_id): (r.state, r.attempts) for r in rows(outbox)}
    assert state[k[1]] == (State.PENDING, 1)  # failed: backs off
    assert state[k[2]] == (State.PENDING, 0)  # given back unpublished: no attempt burned
    assert state[k[3]] == (State.PENDING, 0)  # beyond the run: never claimed


def test_ordered_run_never_skips_a_head_another_claim_holds(backend: str, outbox: Outbox) -> None:
    if not outbox.dialect.row_locks:
        pytest.skip("SQLite claims are serial: no claim can be open during another")
    with outbox.engine.begin() as conn:
        k = [outbox.enqueue(conn, "t", {"i": i}, key="k") for i in range(3)]
        free = outbox.enqueue(conn, "t", {}, key="other")
    d = outbox.dialect
    with connection(outbox) as a, connection(outbox) as b:
        set_lock_timeout(b, backend, 2)
        d.session.prepare(a)
        a.begin()
        assert [e.event_id for e in claim(outbox, a, "a", ordered=True, limit=1)] == [k[0]]
        # k[0] is locked, not yet leased: SKIP LOCKED skips it, the run check stops k there.
        taken = d.keys.claim_runs(b, limit=10, lease=LEASE, token="b", run_length=3)
        assert [e.event_id for e in taken] == [free]
        a.commit()
        d.mark_sent(a, [rows(outbox)[0].id], token="a", delete=False)
        taken = d.keys.claim_runs(b, limit=10, lease=LEASE, token="b2", run_length=3)
        assert [e.event_id for e in taken] == k[1:]


def test_ordered_claims_visit_every_key_in_turn(outbox: Outbox) -> None:
    # Six keys with three events each, two keys per claim: without the
    # round-robin cursor the first keys' later events would take every claim.
    keys = [f"k{i}" for i in range(6)]
    with outbox.engine.begin() as conn:
        for _ in range(3):
            for key in keys:
                outbox.enqueue(conn, "t", {}, key=key)
    served: list[str] = []
    with connection(outbox) as conn:
        for n in range(3):
            events = claim(outbox, conn, f"c{n}", ordered=True, limit=2)
            assert len(events) == 2
            served += [str(e.key) for e in events]
            outbox.dialect.mark_sent(conn, [e.id for e in events], token=f"c{n}", delete=False)
    assert sorted(served) == keys


def test_ordered_claim_reaches_a_key_behind_a_deep_backlog(outbox: Outbox) -> None:
    deep = enqueue_many(outbox, 60, key="a")
    (late,) = enqueue_many(outbox, 1, key="b")
    d = outbox.dialect
    with connection(outbox) as conn:
        heads = claim(outbox, conn, "h", ordered=True, limit=5)
        assert sorted(e.event_id for e in heads) == sorted([deep[0], late])
        d.mark_sent(conn, [e.id for e in heads], token="h", delete=False)
        runs = d.keys.claim_runs(conn, limit=10, lease=LEASE, token="r", run_length=3)
        assert [e.event_id for e in runs] == deep[1:4]


def test_ordered_claim_is_not_crowded_out_by_events_not_yet_due(outbox: Outbox) -> None:
    with outbox.engine.begin() as conn:
        for i in range(5):
            outbox.enqueue(conn, "t", {"i": i}, delay=3600)  # keyless, due in an hour
            outbox.enqueue(conn, "t", {"i": i}, key="later", delay=3600)
        due = outbox.enqueue(conn, "t", {}, key="now")
    with connection(outbox) as conn:
        assert [e.event_id for e in claim(outbox, conn, "c", ordered=True, limit=5)] == [due]


def test_ordered_claim_walks_past_keys_that_are_all_blocked(outbox: Outbox) -> None:
    # limit=1 walks two keys at a time: the first four keys' heads are leased,
    # the claim keeps walking instead of coming back empty.
    blocked = [f"a{i}" for i in range(4)]
    with outbox.engine.begin() as conn:
        for key in blocked:
            outbox.enqueue(conn, "t", {}, key=key)
            outbox.enqueue(conn, "t", {}, key=key)
        free = outbox.enqueue(conn, "t", {}, key="z")
    d = outbox.dialect
    with connection(outbox) as conn:
        heads = d.claim(conn, limit=4, lease=LEASE, token="h", ordered=True)
        assert sorted(str(e.key) for e in heads) == blocked
        assert [e.event_id for e in claim(outbox, conn, "c", ordered=True, limit=1)] == [free]


def _claim_index(outbox: Outbox) -> str:
    """The index ordered claims walk: partial where the database has partial indexes."""
    t = outbox.table.name
    return f"ix_{t}_pending_key" if outbox.dialect.partial_indexes else f"ix_{t}_state_key_id"


def _index_names(outbox: Outbox) -> set[str]:
    return {ix["name"] for ix in sa.inspect(outbox.engine).get_indexes(outbox.table.name)}


def test_install_adds_an_index_missing_from_an_older_table(outbox: Outbox) -> None:
    name = _claim_index(outbox)
    with outbox.engine.begin() as conn:
        detached_index(outbox.table, name).drop(conn)
    outbox.install()
    assert name in _index_names(outbox)


def test_install_upgrades_a_table_with_the_old_index_set(outbox: Outbox) -> None:
    """The indexes of earlier versions (every state change wrote them) go; the new ones stay."""
    t = outbox.table
    old = obsolete_indexes(t, outbox.dialect.partial_indexes)
    columns = {"state_lease": ["state", "lease_until"], "state_id": ["state", "id"]}
    columns["state_key_id"] = ["state", "key", "id"]
    with outbox.engine.begin() as conn:
        for name in old:
            suffix = name.removeprefix(f"ix_{t.name}_")
            copy = sa.Table(t.name, sa.MetaData(), *(sa.Column(c) for c in columns[suffix]))
            if name not in _index_names(outbox):
                sa.Index(name, *copy.c).create(conn)
    assert set(old) <= _index_names(outbox)
    outbox.install()
    present = _index_names(outbox)
    assert not set(old) & present
    assert _claim_index(outbox) in present
    outbox.install()  # idempotent
    assert _index_names(outbox) == present


# -- wake-ups -----------------------------------------------------------------------------


def _wake_up_after(outbox: Outbox, produce: Any) -> bool:
    """Run ``produce(conn)`` in a committed transaction; did a LISTENing relay hear of it?"""
    listener = outbox.dialect.enqueue.listener(outbox.engine)
    if listener is None:
        pytest.skip(f"{outbox.dialect.name} has no notifications: relays poll")
    try:
        with outbox.engine.begin() as conn:
            produce(conn)
        return listener.wait(2.0)
    finally:
        listener.close()


def test_a_committed_enqueue_wakes_the_relays(outbox: Outbox) -> None:
    assert _wake_up_after(outbox, lambda conn: outbox.enqueue(conn, "t", {}))


def test_a_rolled_back_savepoint_does_not_lose_the_wake_up(outbox: Outbox) -> None:
    """The first enqueue (which carried the NOTIFY) is inside a savepoint that rolls back."""

    def produce(conn: sa.Connection) -> None:
        savepoint = conn.begin_nested()
        outbox.enqueue(conn, "t", {"n": 1})
        savepoint.rollback()
        outbox.enqueue(conn, "t", {"n": 2})

    assert _wake_up_after(outbox, produce)
    assert [r.payload for r in rows(outbox)] == [{"n": 2}]


def test_a_rolled_back_transaction_wakes_nobody(outbox: Outbox) -> None:
    listener = outbox.dialect.enqueue.listener(outbox.engine)
    if listener is None:
        pytest.skip(f"{outbox.dialect.name} has no notifications: relays poll")
    try:
        with outbox.engine.connect() as conn, conn.begin() as tx:
            outbox.enqueue(conn, "t", {})
            tx.rollback()
        assert not listener.wait(1.0)
    finally:
        listener.close()


# -- guarantee 4, exactly as the README words it -----------------------------------------


def _publish_all(outbox: Outbox) -> list[str]:
    relay, queue = _relay(outbox, ordered=True)
    while relay.run_once().claimed:
        pass
    relay.close()
    return [e.event_id for e in queue.snapshot()]


@pytest.mark.needs_server
def test_unserialised_writers_of_one_key_are_published_in_commit_order(
    outbox: Outbox, backend: str
) -> None:
    """Ids 1 and 2 of key k, the transaction of 2 commits first: 2 goes out first."""
    if not outbox.dialect.row_locks:
        pytest.skip("SQLite writers are serialised by its write lock")
    with outbox.engine.connect() as first, outbox.engine.connect() as second:
        tx1 = first.begin()
        one = outbox.enqueue(first, "t", {"n": 1}, key="k")  # the smaller id
        with second.begin():
            two = outbox.enqueue(second, "t", {"n": 2}, key="k")
        published = _publish_all(outbox)  # the relay cannot see id 1 yet
        tx1.commit()
    published += _publish_all(outbox)
    assert [r.event_id for r in rows(outbox)] == [one, two]  # ids in enqueue order
    assert published == [two, one]


def test_serialised_writers_of_one_key_are_published_in_id_order(outbox: Outbox) -> None:
    """Each writer locks the aggregate row first: ids follow commit order, and publishing too."""
    orders = sa.Table(
        f"{outbox.table.name}_orders",
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("version", sa.Integer),
    )
    orders.create(outbox.engine)
    try:
        with outbox.engine.begin() as conn:
            conn.execute(orders.insert().values(id=1, version=0))
        ids = []
        for n in range(5):
            with outbox.engine.begin() as conn:
                conn.execute(
                    sa.select(orders).where(orders.c.id == 1).with_for_update()
                )  # the aggregate lock
                conn.execute(orders.update().values(version=orders.c.version + 1))
                ids.append(outbox.enqueue(conn, "t", {"n": n}, key="order-1"))
        assert _publish_all(outbox) == ids
    finally:
        orders.drop(outbox.engine)


# -- run(): claims in flight while a batch is published ------------------------------------


@pytest.mark.parametrize(
    "ordered, ordering",
    [(False, "partitions"), (True, "partitions"), (True, "heads")],
    ids=["unordered", "partitions", "heads"],
)
def test_run_drains_every_event_once_with_claims_in_flight(
    outbox: Outbox, ordered: bool, ordering: str
) -> None:
    """Two claims in flight (row locks; one on SQLite; ordered by partitions, one per lane):
    all sent once, each key in order."""
    queue = MemoryQueue(f"run-{outbox.table.name}")
    with outbox.engine.begin() as conn:
        outbox.enqueue_many(
            conn, [{"topic": "t", "payload": {"n": i}, "key": f"k{i % 7}"} for i in range(1500)]
        )
    relay = outbox.relay(
        MemoryBroker(queue),
        batch_size=100,
        ordered=ordered,
        ordering=ordering,
        reap_interval=0,
        cleanup_after=0,
    )
    assert relay.claim_depth == (2 if outbox.dialect.row_locks else 1)
    sent = 0

    def count(result: Any) -> None:
        nonlocal sent
        sent += result.sent
        if sent >= 1500:
            relay.stop()

    relay.observers.append(OnCycle(count))
    worker = threading.Thread(target=relay.run, kwargs={"install_signal_handlers": False})
    worker.start()
    worker.join(120)
    assert not worker.is_alive()
    published = [e.payload["n"] for e in queue.snapshot()]
    assert sorted(published) == list(range(1500))  # each exactly once
    if ordered:
        for k in range(7):
            of_key = [n for n in published if n % 7 == k]
            assert of_key == sorted(of_key)
    states = {int(r.state) for r in rows(outbox)}
    assert states == {int(State.SENT)}  # nothing left leased: prefetched claims given back


def test_stopping_gives_back_the_claims_in_flight(outbox: Outbox) -> None:
    with outbox.engine.begin() as conn:
        outbox.enqueue_many(conn, [{"topic": "t", "payload": i} for i in range(3000)])
    queue = MemoryQueue(f"stop-{outbox.table.name}")
    relay = outbox.relay(MemoryBroker(queue), batch_size=100, reap_interval=0, cleanup_after=0)
    # Stop after the first settled batch.
    relay.observers.append(OnCycle(lambda result: relay.stop()))
    worker = threading.Thread(target=relay.run, kwargs={"install_signal_handlers": False})
    worker.start()
    worker.join(60)
    assert not worker.is_alive()
    by_state: dict[int, int] = {}
    for r in rows(outbox):
        by_state[int(r.state)] = by_state.get(int(r.state), 0) + 1
    assert int(State.LEASED) not in by_state, by_state  # prefetched batches were released
    assert by_state.get(int(State.SENT), 0) == len(queue.snapshot())
    attempts = {int(r.attempts) for r in rows(outbox) if int(r.state) == int(State.PENDING)}
    assert attempts <= {0}  # a given-back claim spends no attempt
