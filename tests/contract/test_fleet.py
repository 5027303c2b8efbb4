"""One relay over many outboxes: discovery, turns, probes, wake-ups and the refusals.

The fleet's logic against the real databases (PostgreSQL schemas, MariaDB
databases); the brokers, faults and kills are in tests/faults and tests/chaos.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from outbox_core import Outbox
from outbox_core.brokers.memory import MemoryBroker, get_queue
from outbox_core.cli import main
from outbox_core.config import Settings
from outbox_core.errors import ConfigurationError
from outbox_core.fleet import FleetRelay
from tests.conftest import reachable_url

pytestmark = pytest.mark.needs_server


def _schemas(url: str, names: list[str], *, install: bool = True) -> None:
    engine = sa.create_engine(url)
    is_mysql = engine.dialect.name in ("mysql", "mariadb")
    with engine.begin() as conn:
        for name in names:
            kind = "DATABASE" if is_mysql else "SCHEMA"
            conn.execute(
                sa.text(f"DROP {kind} IF EXISTS {name}" + ("" if is_mysql else " CASCADE"))
            )
            conn.execute(sa.text(f"CREATE {kind} {name}"))
    engine.dispose()
    if install:
        for name in names:
            outbox = Outbox(url, schema=name)
            outbox.install()
            outbox.dispose()


def _drop(url: str, names: list[str]) -> None:
    engine = sa.create_engine(url)
    is_mysql = engine.dialect.name in ("mysql", "mariadb")
    with engine.begin() as conn:
        for name in names:
            kind = "DATABASE" if is_mysql else "SCHEMA"
            conn.execute(
                sa.text(f"DROP {kind} IF EXISTS {name}" + ("" if is_mysql else " CASCADE"))
            )
    engine.dispose()


@pytest.fixture
def pg(tmp_path: Path) -> str:
    return reachable_url("postgresql", tmp_path)


@pytest.fixture
def maria(tmp_path: Path) -> str:
    return reachable_url("mysql", tmp_path)


@pytest.fixture
def prefix() -> str:
    return f"fl{uuid.uuid4().hex[:6]}_"


@pytest.fixture
def tenants(pg: str, maria: str, prefix: str) -> Iterator[tuple[list[str], list[str]]]:
    pg_names = [f"{prefix}t{i}" for i in range(4)]
    maria_names = [f"{prefix}m{i}" for i in range(2)]
    _schemas(pg, pg_names)
    _schemas(maria, maria_names)
    yield pg_names, maria_names
    _drop(pg, pg_names)
    _drop(maria, maria_names)


def _enqueue(url: str, schema: str, n: int, *, keys: int = 3, commit: bool = True) -> list[str]:
    outbox = Outbox(url, schema=schema)
    ids = []
    with outbox.engine.connect() as conn, conn.begin() as tx:
        for i in range(n):
            ids.append(outbox.enqueue(conn, topic="t.fleet", key=f"k{i % keys}", payload={"i": i}))
        if not commit:
            tx.rollback()
    outbox.dispose()
    return ids


def _maria_urls(maria: str, names: list[str]) -> list[str]:
    base = sa.make_url(maria)
    return [base.set(database=name).render_as_string(hide_password=False) for name in names]


def test_one_fleet_drains_postgresql_schemas_and_mariadb_databases_in_key_order(
    pg: str, maria: str, prefix: str, tenants: tuple[list[str], list[str]]
) -> None:
    pg_names, maria_names = tenants
    committed: dict[str, list[str]] = {}
    rolled_back: set[str] = set()
    for name in pg_names:
        committed[name] = _enqueue(pg, name, 40)
        rolled_back |= set(_enqueue(pg, name, 5, commit=False))
    maria_urls = _maria_urls(maria, maria_names)
    for name, url in zip(maria_names, maria_urls, strict=True):
        committed[name] = _enqueue(url, None, 40)  # type: ignore[arg-type]
    queue = f"fleet-{prefix}"
    broker = MemoryBroker(get_queue(queue))
    settings = Settings(
        database_url=pg,
        database_urls=tuple(maria_urls),
        schemas=f"{prefix}t*",
        ordering="heads",
        batch_size=7,
        poll_interval=0.05,
    )
    # --schemas applies to each database: MariaDB URLs naming one database each
    # have no schema matching the PostgreSQL pattern: they are given without it.
    settings = settings.replace(schemas=None)
    fleet_pg = FleetRelay(settings.replace(database_urls=(), schemas=f"{prefix}t*"), broker)
    fleet_maria = FleetRelay(
        settings.replace(database_url=maria_urls[0], database_urls=(maria_urls[1],)), broker
    )
    assert sorted(fleet_pg.labels) == pg_names
    assert sorted(fleet_maria.labels) == maria_names
    expected = sum(len(v) for v in committed.values())
    threads = [
        threading.Thread(target=f.run, kwargs={"install_signal_handlers": False})
        for f in (fleet_pg, fleet_maria)
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while len(get_queue(queue).snapshot()) < expected and time.monotonic() < deadline:
        time.sleep(0.05)
    for f in (fleet_pg, fleet_maria):
        f.stop()
    for t in threads:
        t.join(30)
    events = get_queue(queue).snapshot()
    got = {e.event_id for e in events}
    assert got == {i for ids in committed.values() for i in ids}
    assert not got & rolled_back
    # Per key, inside each outbox, in commit (id) order.
    by_key: dict[tuple[str, str | None], list[str]] = {}
    owner = {i: name for name, ids in committed.items() for i in ids}
    for event in events:
        by_key.setdefault((owner[event.event_id], event.key), []).append(event.event_id)
    for (name, _key), ids in by_key.items():
        order = [i for i in committed[name] if i in set(ids)]
        assert ids == order, name


def test_turns_go_round_the_outboxes_with_work(
    pg: str, prefix: str, tenants: tuple[list[str], list[str]]
) -> None:
    pg_names, _ = tenants
    for name in pg_names:
        _enqueue(pg, name, 12 if name == pg_names[0] else 6)
    fleet = FleetRelay(
        Settings(database_url=pg, schemas=f"{prefix}t*", batch_size=2, weights={pg_names[0]: 2}),
        MemoryBroker(get_queue(f"turns-{prefix}")),
    )
    try:
        served = []
        for _ in range(8):
            result = fleet.run_once()
            assert result.sent == 2
            served.append(get_queue(f"turns-{prefix}").snapshot()[-1].payload)
        owners = [lane.label for lane in fleet.lanes]
        assert owners == pg_names
    finally:
        fleet.close()
    events = get_queue(f"turns-{prefix}").snapshot()
    assert len(events) == 16
    # The weighted outbox took 2 batches per turn, the others 1: t0 t0 t1 t2 t3 t0 t0 t1.
    outbox_of = {}
    for name in pg_names:
        engine = sa.create_engine(pg)
        with engine.connect() as conn:
            for (event_id,) in conn.execute(sa.text(f"SELECT event_id FROM {name}.outbox")):
                outbox_of[str(event_id)] = name
        engine.dispose()
    turns = [outbox_of[e.event_id] for e in events[::2]]
    t0, t1, t2, t3 = pg_names
    assert turns == [t0, t0, t1, t2, t3, t0, t0, t1]


def test_an_idle_fleet_asks_each_database_one_statement_per_look(
    pg: str, prefix: str, tenants: tuple[list[str], list[str]]
) -> None:
    pg_names, _ = tenants
    fleet = FleetRelay(
        Settings(database_url=pg, schemas=f"{prefix}t*", poll_interval=0.05, notify=False),
        MemoryBroker(get_queue(f"idle-{prefix}")),
    )
    statements: list[str] = []
    engine = fleet.databases[0].engine

    @sa.event.listens_for(engine, "before_cursor_execute")
    def record(conn, cursor, statement, parameters, context, executemany):  # type: ignore[no-untyped-def]
        statements.append(statement)

    try:
        for _ in range(5):
            assert fleet.run_once().claimed == 0
    finally:
        fleet.close()
    probes = [s for s in statements if "EXISTS" in s]
    assert len(probes) == 5  # one per look, for the 4 outboxes together
    assert all(s.count("EXISTS") == 2 * len(pg_names) for s in probes)
    assert not [s for s in statements if "FOR UPDATE" in s or "UPDATE " in s]


def test_a_notify_names_its_outbox_and_wakes_the_fleet(
    pg: str, prefix: str, tenants: tuple[list[str], list[str]]
) -> None:
    pg_names, _ = tenants
    queue = f"wake-{prefix}"
    fleet = FleetRelay(
        Settings(database_url=pg, schemas=f"{prefix}t*", poll_interval=0.05, max_poll_interval=60),
        MemoryBroker(get_queue(queue)),
    )
    thread = threading.Thread(target=fleet.run, kwargs={"install_signal_handlers": False})
    thread.start()
    try:
        # Idle long enough that polling has backed off towards a minute.
        deadline = time.monotonic() + 10
        while fleet.cycle.probes < 6 and time.monotonic() < deadline:
            time.sleep(0.05)
        probes = fleet.cycle.probes
        started = time.monotonic()
        (event_id,) = _enqueue(pg, pg_names[2], 1)
        while not get_queue(queue).snapshot() and time.monotonic() - started < 5:
            time.sleep(0.005)
        took = time.monotonic() - started
        assert [e.event_id for e in get_queue(queue).snapshot()] == [event_id]
        assert took < 2.0, f"a NOTIFY woke the fleet after {took:.2f}s"
        assert fleet.cycle.probes - probes <= 2
    finally:
        fleet.stop()
        thread.join(30)


def test_outboxes_added_are_found_and_removed_ones_let_go(
    pg: str, prefix: str, tenants: tuple[list[str], list[str]]
) -> None:
    pg_names, _ = tenants
    fleet = FleetRelay(
        Settings(database_url=pg, schemas=f"{prefix}t*"), MemoryBroker(get_queue(f"d-{prefix}"))
    )
    try:
        late = f"{prefix}t9"
        _schemas(pg, [late])
        _drop(pg, [pg_names[1]])
        fleet.discover()
        assert sorted(fleet.labels) == sorted([*pg_names[:1], *pg_names[2:], late])
        (event_id,) = _enqueue(pg, late, 1)
        assert fleet.run_once().sent == 1
        assert get_queue(f"d-{prefix}").snapshot()[-1].event_id == event_id
    finally:
        fleet.close()
        _drop(pg, [f"{prefix}t9"])


def test_the_relay_command_runs_a_fleet_once(
    pg: str, prefix: str, tenants: tuple[list[str], list[str]]
) -> None:
    pg_names, _ = tenants
    _enqueue(pg, pg_names[0], 3)
    result = CliRunner().invoke(
        main,
        [
            "relay",
            "--db",
            pg,
            "--schemas",
            f"{prefix}t*",
            "--broker",
            f"memory://cli-{prefix}",
            "--once",
            "--config",
            "/dev/null",
        ],
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.output.strip().splitlines()[-1])["sent"] == 3


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--ordering", "partitions"], "--ordering heads"),
        (["--source", "wal"], "--source wal relays one outbox"),
    ],
)
def test_what_a_fleet_cannot_do_is_refused_clearly(
    pg: str, prefix: str, extra: list[str], message: str
) -> None:
    result = CliRunner().invoke(
        main,
        ["relay", "--db", pg, "--schemas", f"{prefix}t*", "--broker", "memory://x", *extra],
    )
    assert result.exit_code == 2
    assert message in result.output


def test_a_fleet_refuses_key_partitions_in_the_api(pg: str) -> None:
    with pytest.raises(ConfigurationError, match="heads"):
        FleetRelay(Settings(database_url=pg, schemas="x*", ordering="partitions"), MemoryBroker())


def test_two_urls_of_one_mariadb_server_relay_each_table_once(
    maria: str, prefix: str, tenants: tuple[list[str], list[str]]
) -> None:
    _, maria_names = tenants
    urls = _maria_urls(maria, maria_names)
    fleet = FleetRelay(
        Settings(database_url=urls[0], database_urls=(urls[1],), schemas=f"{prefix}m*"),
        MemoryBroker(get_queue(f"once-{prefix}")),
    )
    try:
        assert sorted(fleet.labels) == maria_names
        assert [len(db.lanes) for db in fleet.databases] == [2, 0]
    finally:
        fleet.close()
