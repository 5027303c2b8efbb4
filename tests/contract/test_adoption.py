"""A team's own outbox table (Debezium's layout) relayed as it is: ``install --columns``.

The table is made and written by plain SQL, as the team's service does;
``outbox install --columns`` adds the toolkit's bookkeeping, after which the
team's INSERTs keep working and a relay publishes their rows with the ids,
keys and topics they wrote, each key in insertion order. A table that cannot
be adopted is refused before anything changes, on MySQL and MariaDB too,
whose DDL is not transactional.
"""

from __future__ import annotations

import json
import shlex
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from outbox_core.brokers.memory import MemoryBroker, MemoryQueue
from outbox_core.errors import AdoptionRefused
from outbox_core.message import Event
from outbox_core.outbox import Outbox
from tests.support import outbox_cli

DEBEZIUM = "event_id=id,key=aggregate_id,topic=event_type"


def _debezium_ddl(backend: str, table: str) -> str:
    """Debezium's outbox layout as each database spells it (SQLite: an INTEGER key too)."""
    if backend == "postgresql":
        return (
            f"CREATE TABLE {table} (id uuid PRIMARY KEY, aggregate_type varchar(255) NOT NULL, "
            "aggregate_id varchar(255) NOT NULL, event_type varchar(255) NOT NULL, "
            "payload jsonb)"
        )
    if backend == "mysql":
        return (
            f"CREATE TABLE {table} (id char(36) PRIMARY KEY, aggregate_type varchar(255) "
            "NOT NULL, aggregate_id varchar(255) NOT NULL, event_type varchar(255) NOT NULL, "
            "payload json) ENGINE=InnoDB"
        )
    # SQLite cannot add an auto-numbered column: the table brings one, and its clock.
    return (
        f"CREATE TABLE {table} (seq INTEGER PRIMARY KEY AUTOINCREMENT, id char(36) NOT NULL "
        "UNIQUE, aggregate_type varchar(255) NOT NULL, aggregate_id varchar(255) NOT NULL, "
        "event_type varchar(255) NOT NULL, payload text, "
        "created_at timestamp NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now')))"
    )


def _columns(backend: str) -> str:
    return DEBEZIUM + (",id=seq" if backend == "sqlite" else "")


class TeamTable:
    """The team's table and its plain-SQL writer."""

    def __init__(self, url: str, backend: str, name: str) -> None:
        self.url = url
        self.backend = backend
        self.name = name
        self.engine = sa.create_engine(url)

    def create(self) -> None:
        with self.engine.begin() as conn:
            conn.exec_driver_sql(_debezium_ddl(self.backend, self.name))

    def insert(self, rows: list[tuple[str, str, str, dict[str, Any]]]) -> None:
        """``(id, aggregate_id, event_type, payload)`` rows, as the team's service writes them."""
        statement = sa.text(
            f"INSERT INTO {self.name} (id, aggregate_type, aggregate_id, event_type, payload) "
            "VALUES (:id, 'order', :key, :type, :payload)"
        )
        with self.engine.begin() as conn:
            for event_id, key, event_type, payload in rows:
                conn.execute(
                    statement,
                    {
                        "id": event_id,
                        "key": key,
                        "type": event_type,
                        "payload": json.dumps(payload),
                    },
                )

    def shape(self) -> tuple[list[str], list[str]]:
        """Its columns and indexes: what a refused adoption must leave as it was."""
        inspector = sa.inspect(self.engine)
        columns = sorted(c["name"] for c in inspector.get_columns(self.name))
        indexes = sorted(str(ix["name"]) for ix in inspector.get_indexes(self.name))
        return columns, indexes

    def drop(self, outbox: Outbox | None) -> None:
        if outbox is not None:
            outbox.tables.metadata.drop_all(outbox.engine, tables=outbox.tables.companions)
            outbox.dispose()
        with self.engine.begin() as conn:
            conn.exec_driver_sql(f"DROP TABLE IF EXISTS {self.name}")
        self.engine.dispose()


@pytest.fixture
def team(db_url: str, backend: str, table_name: str) -> Iterator[TeamTable]:
    table = TeamTable(db_url, backend, table_name)
    table.create()
    holder: dict[str, Outbox] = {}
    table.outbox = holder  # type: ignore[attr-defined]
    try:
        yield table
    finally:
        table.drop(holder.get("outbox"))


def _adopted(team: TeamTable) -> Outbox:
    outbox = Outbox(team.url, table=team.name, columns=_columns(team.backend))
    team.outbox["outbox"] = outbox  # type: ignore[attr-defined]
    return outbox


def _rows(n: int, keys: int, start: int = 0) -> list[tuple[str, str, str, dict[str, Any]]]:
    return [
        (str(uuid.uuid4()), f"order-{i % keys}", "OrderCreated", {"n": i})
        for i in range(start, start + n)
    ]


def _drain(outbox: Outbox, *, ordered: bool = True) -> list[Event]:
    queue = MemoryQueue(f"adopt-{uuid.uuid4().hex}")
    relay = outbox.relay(MemoryBroker(queue), ordered=ordered)
    try:
        while relay.run_once().claimed:
            pass
    finally:
        relay.close()
    return queue.snapshot()


def test_a_debezium_table_written_by_plain_inserts_is_relayed_as_it_is(team: TeamTable) -> None:
    before = _rows(3, keys=2)
    team.insert(before)  # published by the tool the table comes from
    result = outbox_cli(
        "install",
        "--db",
        team.url,
        "--table",
        team.name,
        "--columns",
        _columns(team.backend),
        "--existing",
        "sent",
    )
    assert result.returncode == 0, result.stderr
    after = _rows(12, keys=3, start=3)
    team.insert(after)  # the team's INSERTs, unchanged, after the adoption
    outbox = _adopted(team)
    published = _drain(outbox)
    assert [(e.event_id, e.key, e.topic, e.payload) for e in published] == [
        (i, k, t, p) for i, k, t, p in after
    ]
    for key in {k for _, k, _, _ in after}:
        assert [e.payload["n"] for e in published if e.key == key] == sorted(
            p["n"] for _, k, _, p in after if k == key
        )
    assert outbox.status().counts == {"pending": 0, "leased": 0, "sent": 15, "dead": 0}


def test_existing_rows_stay_pending_unless_told_they_were_sent(team: TeamTable) -> None:
    rows = _rows(4, keys=2)
    team.insert(rows)
    outbox = _adopted(team)
    outbox.install()
    # Numbered as the database stores them (InnoDB: in primary key order), not
    # necessarily as written: docs/adopting.md says so.
    assert sorted(e.event_id for e in _drain(outbox)) == sorted(r[0] for r in rows)


def test_a_second_install_changes_nothing_and_marks_no_row_sent(team: TeamTable) -> None:
    outbox = _adopted(team)
    outbox.install(existing="sent")
    shape = team.shape()
    rows = _rows(2, keys=1)
    team.insert(rows)
    outbox.install(existing="sent")  # adds nothing: the rows written since stay pending
    assert team.shape() == shape
    assert outbox.status().counts["pending"] == 2


def test_the_toolkit_enqueues_into_an_adopted_table_beside_the_teams_inserts(
    team: TeamTable,
) -> None:
    outbox = _adopted(team)
    outbox.install()
    with team.engine.begin() as conn:
        conn.exec_driver_sql(f"ALTER TABLE {team.name} DROP COLUMN aggregate_type")
    team_rows = [(str(uuid.uuid4()), "order-1", "OrderCreated", {"n": 1})]
    with team.engine.begin() as conn:
        conn.execute(
            sa.text(
                f"INSERT INTO {team.name} (id, aggregate_id, event_type, payload) "
                "VALUES (:id, 'order-1', 'OrderCreated', :payload)"
            ),
            {"id": team_rows[0][0], "payload": json.dumps({"n": 1})},
        )
    with outbox.engine.begin() as conn:
        mine = outbox.enqueue(conn, "OrderShipped", {"n": 2}, key="order-1")
    published = _drain(outbox)
    assert [(e.event_id, e.topic, e.payload) for e in published] == [
        (team_rows[0][0], "OrderCreated", {"n": 1}),
        (mine, "OrderShipped", {"n": 2}),
    ]


def test_install_without_columns_refuses_the_layout_and_the_doctors_fix_works(
    team: TeamTable,
) -> None:
    shape = team.shape()
    plain = outbox_cli("install", "--db", team.url, "--table", team.name)
    assert plain.returncode == 2
    assert "another layout" in plain.stderr and "nothing was changed" in plain.stderr
    assert team.shape() == shape
    doctor = outbox_cli("doctor", "--db", team.url, "--table", team.name, "--json")
    assert doctor.returncode == 1
    findings = json.loads(doctor.stdout)["findings"]
    layout = next(f for f in findings if "another layout" in f["message"])
    assert "--columns" in layout["fix"]
    if team.backend == "sqlite":
        # SQLite's guess cannot know the table's own auto-numbered column: the
        # doctor names the columns it found; the fix needs id= as well.
        assert "event_id=id" in layout["fix"] and "topic=event_type" in layout["fix"]
        return
    command = shlex.split(layout["fix"].split("  (")[0])
    assert command[0] == "outbox"
    fixed = outbox_cli(*command[1:])
    assert fixed.returncode == 0, fixed.stderr
    again = outbox_cli(
        "doctor", "--db", team.url, "--table", team.name, "--columns", DEBEZIUM, "--json"
    )
    assert again.returncode == 0, again.stdout
    # Debezium's aggregate_type NOT NULL: the team's INSERTs fill it, enqueue() cannot.
    unfilled = [f for f in json.loads(again.stdout)["findings"] if "NOT NULL" in f["message"]]
    assert unfilled and "aggregate_type" in unfilled[0]["message"]
    assert unfilled[0]["severity"] == "warning"


@pytest.mark.parametrize(
    "problem",
    ["missing_column", "state_of_another_kind", "duplicate_ids", "wrong_type"],
)
def test_a_table_that_cannot_be_adopted_is_refused_before_any_change(
    team: TeamTable, problem: str
) -> None:
    columns = _columns(team.backend)
    with team.engine.begin() as conn:
        if problem == "missing_column":
            columns = columns.replace("topic=event_type", "topic=kind")
        elif problem == "state_of_another_kind":
            conn.exec_driver_sql(f"ALTER TABLE {team.name} ADD state varchar(20)")
        elif problem == "duplicate_ids":
            columns = "event_id=aggregate_type,key=aggregate_id,topic=event_type,id=" + (
                "seq" if team.backend == "sqlite" else "outbox_seq"
            )
            conn.exec_driver_sql(
                f"INSERT INTO {team.name} (id, aggregate_type, aggregate_id, event_type, payload) "
                f"VALUES ('{uuid.uuid4()}', 'same', 'k', 't', '{{}}'), "
                f"('{uuid.uuid4()}', 'same', 'k', 't', '{{}}')"
            )
        else:
            conn.exec_driver_sql(f"ALTER TABLE {team.name} ADD happened_at integer")
            columns += ",created_at=happened_at"
    shape = team.shape()
    outbox = Outbox(team.url, table=team.name, columns=columns)
    team.outbox["outbox"] = outbox  # type: ignore[attr-defined]
    with pytest.raises(AdoptionRefused, match="nothing was changed") as refused:
        outbox.install()
    expected = {
        "missing_column": "no column kind",
        "state_of_another_kind": "column state is already there",
        "duplicate_ids": "duplicate",
        "wrong_type": "happened_at is",
    }[problem]
    assert expected in str(refused.value)
    assert team.shape() == shape


def test_a_missing_table_is_not_created_under_a_column_map(db_url: str, table_name: str) -> None:
    outbox = Outbox(db_url, table=table_name, columns=DEBEZIUM)
    try:
        result = outbox_cli("install", "--db", db_url, "--table", table_name, "--columns", DEBEZIUM)
        assert result.returncode == 2
        assert f"table {table_name} does not exist" in result.stderr
        assert not sa.inspect(outbox.engine).has_table(table_name)
    finally:
        outbox.dispose()


def test_existing_needs_a_column_map(db_url: str, table_name: str) -> None:
    result = outbox_cli("install", "--db", db_url, "--table", table_name, "--existing", "sent")
    assert result.returncode == 2
    assert "--existing applies to a table adopted with --columns" in result.stderr


def test_the_relay_command_reads_through_the_map_from_outbox_toml(
    team: TeamTable, tmp_path: Any
) -> None:
    outbox = _adopted(team)
    outbox.install()
    rows = _rows(3, keys=1)
    team.insert(rows)
    config = tmp_path / "outbox.toml"
    mapping = dict(part.split("=") for part in _columns(team.backend).split(","))
    inline = ", ".join(f'{field} = "{column}"' for field, column in mapping.items())
    config.write_text(
        f'database_url = "{team.url}"\ntable = "{team.name}"\ncolumns = {{ {inline} }}\n'
    )
    status = outbox_cli("status", "--config", str(config), "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["counts"]["pending"] == 3
    assert sys.executable  # the CLI runs in this interpreter (tests.support.outbox_cli)


def test_on_mysql_the_change_is_one_statement_all_or_nothing(team: TeamTable) -> None:
    if team.backend != "mysql":
        pytest.skip("MySQL and MariaDB: DDL that is not transactional")
    outbox = _adopted(team)
    statements: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        if statement.lstrip().upper().startswith(("ALTER", "CREATE")):
            statements.append(statement)

    sa.event.listen(outbox.engine, "before_cursor_execute", record)
    dialect = outbox.dialect
    shape = team.shape()
    with outbox.engine.connect() as conn:
        plan = dialect.adoption.plan(conn, partial_indexes=dialect.partial_indexes)
        # A last clause the server refuses: InnoDB must undo every clause before it.
        ghost = sa.Table(team.name, sa.MetaData(), sa.Column("no_such_column"))
        plan.indexes.append(sa.Index(f"ix_{team.name}_ghost", ghost.c.no_such_column))
        with pytest.raises(sa.exc.OperationalError):
            dialect.adoption.apply(conn, plan, existing_sent=False)
    assert team.shape() == shape
    assert len(statements) == 1 and "ADD COLUMN state " in statements[0]
    statements.clear()
    outbox.install()
    on_the_table = [s for s in statements if f" {team.name} " in f" {s} "]
    assert len(on_the_table) == 1 and on_the_table[0].startswith(f"ALTER TABLE {team.name} ")
