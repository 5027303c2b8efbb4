"""``outbox migrate`` without a server: canonical forms, fit checks, resume safety on SQLite,
the CLI's exit codes, and the schema (live SQLite, the Alembic example on every dialect)."""

from __future__ import annotations

import importlib.util
import re
import sys
import types
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from outbox_core import Outbox, State
from outbox_core.cli import migrate_command
from outbox_core.migrate import (
    MigrationRefused,
    SourceEvent,
    TargetLimits,
    canonical_json,
    migrate,
    plan,
    verify_migration,
)
from outbox_core.schema import AddColumn, OutboxTables

ROOT = Path(__file__).resolve().parents[2]
NOW = datetime(2024, 5, 1, 12, 0, 0, 123456)


# -- canonical JSON ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "left, right",
    [
        ({"b": 1, "a": [1, 2]}, {"a": [1, 2], "b": 1}),  # JSONB and MySQL reorder keys
        ({"x": 1.0}, {"x": 1}),  # JSONB keeps 1.0, a text column may hold 1
        ({"x": 1e20}, {"x": 100000000000000000000}),  # JSONB prints 1e20 as digits
        ({"x": 1.5e300}, {"x": 15 * 10**299}),
        ({"x": -0.0}, {"x": 0}),  # numeric has no negative zero
        ({"x": 0.1}, {"x": 0.1}),
        ({"é": "😀\n"}, {"é": "😀\n"}),
    ],
)
def test_canonical_json_is_equal_for_what_databases_return_for_equal_values(
    left: Any, right: Any
) -> None:
    assert canonical_json(left) == canonical_json(right)


@pytest.mark.parametrize(
    "left, right",
    [
        ({"x": 2**64}, {"x": 2**64 + 1}),  # big integers stay exact
        ({"x": 0.1}, {"x": 0.1000001}),
        ({"x": True}, {"x": 1}),
        ({"x": None}, {"x": "null"}),
        ({"x": "1"}, {"x": 1}),
        ({"x": "1.0"}, {"x": "1"}),  # numbers inside strings are left alone
        ({"x": 'q"1.0 \\'}, {"x": 'q"1 \\'}),
        ([1, 2], [2, 1]),
        ({"a": {"b": 1}}, {"a": {"b": 2}}),
        ({"x": 10}, {"x": 1}),
    ],
)
def test_canonical_json_tells_different_values_apart(left: Any, right: Any) -> None:
    assert canonical_json(left) != canonical_json(right)


# -- what a target can store -------------------------------------------------------------


def event(**changes: Any) -> SourceEvent:
    values: dict[str, Any] = {
        "id": 7,
        "event_id": str(uuid.uuid4()),
        "topic": "order.created",
        "key": "order-1",
        "payload": {"a": 1},
        "headers": {"h": "v"},
        "state": int(State.PENDING),
        "attempts": 0,
        "available_at": NOW,
        "created_at": NOW,
        "sent_at": None,
        "last_error": None,
    }
    values.update(changes)
    return SourceEvent(**values)


PG = TargetLimits(
    "postgresql", chars={"event_id": None, "topic": 255, "key": 255}, uuid_event_id=True
)
MYSQL = TargetLimits(
    "mysql",
    chars={"event_id": 36, "topic": 255, "key": 255, "last_error": None},
    max_bytes={"last_error": 65_535},
)
MSSQL = TargetLimits("mssql", chars={"event_id": 36, "topic": 255, "key": 255})


@pytest.mark.parametrize(
    "limits, changes, expected",
    [
        (
            PG,
            {"payload": {"lines": [{"note": "a\x00b"}]}},
            "payload['lines'][0]['note'] contains a NUL",
        ),
        (PG, {"headers": {"x": "\ud800"}}, "headers['x'] contains a lone surrogate"),
        (PG, {"topic": "t\x00"}, "topic contains a NUL character"),
        (PG, {"payload": {"k\x00": 1}}, "payload key 'k\\x00' contains a NUL character"),
        (PG, {"event_id": "not-a-uuid"}, "event_id 'not-a-uuid' is not a UUID"),
        (PG, {"key": "k" * 256}, "key is 256 characters long; the target column holds 255"),
        (PG, {"payload": {"x": float("nan")}}, "payload['x']: nan is not valid JSON"),
        (MYSQL, {"payload": ["\udfff"]}, "payload[0] contains a lone surrogate"),
        (MYSQL, {"last_error": "é" * 40_000}, "last_error is 80000 bytes long"),
        (MYSQL, {"created_at": datetime(999, 1, 1)}, "before 1000-01-01"),
        # SQL Server counts UTF-16 code units: 200 emoji are 400 of them.
        (MSSQL, {"key": "😀" * 200}, "key is 400 characters long; the target column holds 255"),
    ],
)
def test_target_limits_name_what_does_not_fit(
    limits: TargetLimits, changes: dict[str, Any], expected: str
) -> None:
    problem = limits.problem(event(**changes))
    assert problem is not None and expected in problem


def test_target_limits_accept_what_fits() -> None:
    fine = event(key="😀" * 200, payload={"s": "a\x00b", "n": [1.5, 2**70]}, last_error="x")
    assert MYSQL.problem(fine) is None
    assert PG.problem(event(key="😀" * 255)) is None  # PostgreSQL counts characters
    assert TargetLimits("sqlite").problem(event(key="k" * 1000, payload={"s": "\x00"})) is None


def test_mysql_character_sets_narrower_than_utf8mb4_are_checked() -> None:
    limits = TargetLimits("mysql", codecs={"key": "bmp", "topic": "cp1252"})
    bmp = limits.problem(event(key="order-😀"))
    assert bmp is not None and "character set (utf8mb3)" in bmp and "utf8mb4" in bmp
    latin = limits.problem(event(topic="заказ"))
    assert latin is not None and "(cp1252)" in latin
    assert limits.problem(event(key="ordre-é", topic="commande.créée")) is None


# -- migrate and verify on SQLite files --------------------------------------------------


@pytest.fixture
def sqlite_pair(tmp_path: Path) -> Iterator[tuple[Outbox, Outbox]]:
    source = Outbox(f"sqlite:///{tmp_path / 'source.db'}")
    target = Outbox(f"sqlite:///{tmp_path / 'target.db'}")
    source.install()
    target.install()
    yield source, target
    source.dispose()
    target.dispose()


def produce(outbox: Outbox, n: int, keys: int = 3) -> list[str]:
    with outbox.engine.begin() as conn:
        return [
            outbox.enqueue(conn, "t", {"i": i}, key=f"k{i % keys}", headers={"n": str(i)})
            for i in range(n)
        ]


def rows(outbox: Outbox) -> list[sa.Row[Any]]:
    t = outbox.table
    with outbox.engine.connect() as conn:
        return list(conn.execute(sa.select(t).order_by(t.c.id)).all())


def test_every_state_is_mapped_and_a_rerun_copies_nothing(
    sqlite_pair: tuple[Outbox, Outbox],
) -> None:
    source, target = sqlite_pair
    ids = produce(source, 8)
    t = source.table
    with source.engine.begin() as conn:
        conn.execute(
            sa.update(t)
            .where(t.c.event_id == ids[1])
            .values(state=int(State.LEASED), lease_owner="r:1:x", lease_until=NOW, attempts=2)
        )
        conn.execute(
            sa.update(t)
            .where(t.c.event_id == ids[2])
            .values(state=int(State.DEAD), last_error="boom", attempts=10)
        )
        conn.execute(
            sa.update(t).where(t.c.event_id == ids[3]).values(state=int(State.SENT), sent_at=NOW)
        )
    report = migrate(source, target, batch=3)
    assert (report.copied, report.skipped, report.batches) == (7, 0, 3)
    assert report.copied_by_state == {"pending": 5, "leased": 1, "sent": 0, "dead": 1}
    copied = {r.event_id: r for r in rows(target)}
    assert ids[3] not in copied
    leased = copied[ids[1]]
    assert (leased.state, leased.attempts, leased.lease_owner, leased.lease_until) == (
        int(State.PENDING),
        2,
        None,
        None,
    )
    assert (copied[ids[2]].state, copied[ids[2]].last_error) == (int(State.DEAD), "boom")
    again = migrate(source, target)
    assert (again.copied, again.skipped) == (0, 7)
    with_sent = migrate(source, target, include_sent=True)
    assert (with_sent.copied, with_sent.copied_by_state["sent"]) == (1, 1)
    sent = next(r for r in rows(target) if r.event_id == ids[3])
    assert (sent.state, sent.sent_at) == (int(State.SENT), NOW)
    assert verify_migration(source, target, include_sent=True).ok


def test_a_late_event_that_would_land_behind_a_newer_one_of_its_key_is_refused(
    sqlite_pair: tuple[Outbox, Outbox],
) -> None:
    source, target = sqlite_pair
    ids = produce(source, 6, keys=1)
    migrate(source, target)
    # A gap: the target has events 0, 1, 3, 4, 5 of the key but not 2. Copying 2
    # now would give it the highest id, and the relay would publish it last.
    tt = target.table
    with target.engine.begin() as conn:
        conn.execute(sa.delete(tt).where(tt.c.event_id == ids[2]))
    with pytest.raises(MigrationRefused, match=f"event {ids[2]} .* later event {ids[3]}"):
        migrate(source, target)
    assert len(rows(target)) == 5  # nothing of the batch was written
    forced = migrate(source, target, force=True)
    assert forced.copied == 1 and "out of order" in forced.warnings[0]
    checked = verify_migration(source, target)
    assert not checked.ok
    assert checked.differences[0].event_id == ids[3]
    assert "out of order within key 'k0'" in checked.differences[0].problem


def test_events_of_other_keys_and_unkeyed_events_do_not_count_as_gaps(
    sqlite_pair: tuple[Outbox, Outbox],
) -> None:
    source, target = sqlite_pair
    with source.engine.begin() as conn:
        a = source.enqueue(conn, "t", {}, key="a")
        source.enqueue(conn, "t", {}, key="b")
        source.enqueue(conn, "t", {})
        source.enqueue(conn, "t", {})
    migrate(source, target)
    tt = target.table
    with target.engine.begin() as conn:
        conn.execute(sa.delete(tt).where(tt.c.event_id == a))
    assert migrate(source, target).copied == 1


def test_live_leases_refuse_unless_forced(sqlite_pair: tuple[Outbox, Outbox]) -> None:
    source, target = sqlite_pair
    produce(source, 3)
    relay_claim = source.dialect.claim
    with source.engine.connect() as conn:
        claimed = relay_claim(conn, limit=2, lease=60, token="relay-a:1:abc", ordered=False)
    assert len(claimed) == 2
    with pytest.raises(MigrationRefused, match=r"2 events leased by running relays \(relay-a\)"):
        migrate(source, target)
    assert rows(target) == []
    assert not plan(source, target).ok
    report = migrate(source, target, force=True)
    assert report.copied == 3 and "live leases" in report.warnings[0]
    assert {r.state for r in rows(target)} == {int(State.PENDING)}


def test_refusals_name_the_problem(sqlite_pair: tuple[Outbox, Outbox], tmp_path: Path) -> None:
    source, target = sqlite_pair
    with pytest.raises(MigrationRefused, match="same table"):
        migrate(source, Outbox(source.url))
    missing = Outbox(target.url, table="nowhere")
    with pytest.raises(MigrationRefused, match=r"outbox install --db sqlite:///.* --table nowhere"):
        migrate(source, missing)
    with pytest.raises(MigrationRefused, match="source table 'nowhere' does not exist"):
        migrate(Outbox(source.url, table="nowhere"), target)
    with pytest.raises(MigrationRefused, match="batch must be between"):
        migrate(source, target, batch=0)
    odd = sa.MetaData()
    sa.Table(
        "odd", odd, sa.Column("id", sa.Integer, primary_key=True), sa.Column("state", sa.Integer)
    )
    odd.create_all(target.engine)
    with pytest.raises(MigrationRefused, match=r"no column.*event_id.*not an outbox table"):
        migrate(source, Outbox(target.url, table="odd"))


def test_verify_names_a_changed_payload_a_missing_and_an_extra_event(
    sqlite_pair: tuple[Outbox, Outbox],
) -> None:
    source, target = sqlite_pair
    ids = produce(source, 20)
    migrate(source, target)
    assert verify_migration(source, target).ok
    tt = target.table
    extra = produce(target, 1)[0]
    with target.engine.begin() as conn:
        conn.execute(sa.update(tt).where(tt.c.event_id == ids[4]).values(payload={"i": -1}))
        conn.execute(sa.delete(tt).where(tt.c.event_id == ids[9]))
    checked = verify_migration(source, target)
    assert not checked.ok
    problems = {d.event_id: d.problem for d in checked.differences}
    assert problems == {
        ids[4]: "payload differs",
        ids[9]: "missing on the target",
        extra: "only on the target",
    }
    assert f"first differing events: {ids[4]}, {ids[9]}, {extra}" in checked.render()


def test_progress_is_reported_per_batch(sqlite_pair: tuple[Outbox, Outbox]) -> None:
    source, target = sqlite_pair
    produce(source, 25)
    seen: list[tuple[int, int]] = []
    migrate(source, target, batch=10, progress=lambda done, total: seen.append((done, total)))
    assert seen == [(0, 25), (10, 25), (20, 25), (25, 25)]


# -- the command -------------------------------------------------------------------------


def invoke(*args: str) -> Any:
    return CliRunner().invoke(migrate_command, list(args))


def test_command_copies_verifies_and_reports(sqlite_pair: tuple[Outbox, Outbox]) -> None:
    source, target = sqlite_pair
    produce(source, 30)
    urls = ("--from", str(source.url), "--to", str(target.url))
    checked = invoke(*urls, "--check-only")
    assert checked.exit_code == 0, checked.output
    assert "to copy 30 events; 0 already on the target" in checked.stdout
    assert "ready to migrate" in checked.stdout
    result = invoke(*urls, "--batch", "7", "--verify")
    assert result.exit_code == 0, result.output
    assert re.search(r"copied\s+30\s+\(pending 30\)", result.stdout)
    assert "verify ok" in result.stdout
    # stderr is not a terminal here: plain progress lines instead of a bar.
    assert "migrate: 30/30 events (100%)" in result.stderr
    again = invoke(*urls, "--json")
    assert again.exit_code == 0
    assert '"copied": 0' in again.stdout and '"skipped": 30' in again.stdout
    tt = target.table
    with target.engine.begin() as conn:
        conn.execute(sa.update(tt).where(tt.c.id == 3).values(key="other"))
    checked_only = invoke(*urls, "--verify-only")
    assert checked_only.exit_code == 1
    assert "key differs: 'k2' on the source, 'other' on the target" in checked_only.stdout
    assert "copied" not in checked_only.stdout  # --verify-only copies nothing


def test_command_refuses_in_one_line_with_exit_2(sqlite_pair: tuple[Outbox, Outbox]) -> None:
    source, _ = sqlite_pair
    result = invoke("--from", str(source.url), "--to", str(source.url), "--to-table", "missing")
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith("error: target table 'missing' does not exist")
    assert "outbox install --db" in result.stderr
    check = invoke(
        "--from", str(source.url), "--to", str(source.url), "--to-table", "missing", "--check-only"
    )
    assert check.exit_code == 2 and "table missing" in check.stdout


def test_command_masks_passwords_in_errors(sqlite_pair: tuple[Outbox, Outbox]) -> None:
    source, _ = sqlite_pair
    # Nothing listens on port 1: the connection error names the URL.
    target = "postgresql+psycopg://app:Sekr3tPw@127.0.0.1:1/app?connect_timeout=2"
    result = invoke("--from", str(source.url), "--to", target)
    assert result.exit_code == 2
    assert "Sekr3tPw" not in result.output
    assert result.stderr.startswith("error: ")


# -- the schema: create_all on live SQLite and the Alembic example -----------------------


def test_create_all_on_sqlite_matches_the_table_definitions(tmp_path: Path) -> None:
    tables = OutboxTables.create("events")
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'schema.db'}")
    tables.create_all(engine)
    inspector = sa.inspect(engine)
    for table in (tables.outbox, tables.inbox):
        reflected = {c["name"]: c for c in inspector.get_columns(table.name)}
        assert list(reflected) == [c.name for c in table.columns]
        for column in table.columns:
            got = reflected[column.name]
            assert got["nullable"] == column.nullable, column.name
            expected_type = column.type.dialect_impl(engine.dialect).compile(engine.dialect)
            assert got["type"].compile(engine.dialect) == expected_type, column.name
            assert (got["default"] is not None) == (column.server_default is not None)
        pk = inspector.get_pk_constraint(table.name)["constrained_columns"]
        assert pk == [c.name for c in table.primary_key.columns]
        indexes = {i["name"]: i for i in inspector.get_indexes(table.name)}
        # SQLite has partial indexes: the full (state, ...) ones are MySQL's.
        on_sqlite = {
            i for i in table.indexes if not str(i.name).startswith(f"ix_{table.name}_state")
        }
        assert set(indexes) == {i.name for i in on_sqlite}
        for index in on_sqlite:
            got_index = indexes[index.name]
            assert got_index["column_names"] == [c.name for c in index.columns]
            assert bool(got_index["unique"]) == index.unique
    # SQLite keeps the statements it ran: they are exactly `outbox schema --dialect sqlite`.
    with engine.connect() as conn:
        stored = conn.execute(
            sa.text(
                "SELECT sql FROM sqlite_master WHERE sql IS NOT NULL AND name NOT LIKE 'sqlite_%'"
            )
        ).scalars()
        assert {_normal(s) for s in stored} == _statements(tables.ddl("sqlite"))
    engine.dispose()


def _normal(sql: str) -> str:
    return re.sub(r"\s+", " ", sql).replace("( ", "(").replace(" )", ")").strip().rstrip(";")


def _statements(ddl: str) -> set[str]:
    return {_normal(s) for s in ddl.split(";\n\n") if s.strip()}


class FakeOp:
    """The part of ``alembic.op`` the example uses, on a connection or a mock engine."""

    def __init__(self, bind: Any, dialect: sa.Dialect) -> None:
        self.bind = bind
        self.dialect = dialect
        self.metadata = sa.MetaData()

    def get_context(self) -> Any:
        return types.SimpleNamespace(dialect=self.dialect)

    def create_table(self, name: str, *columns: Any, **kw: Any) -> sa.Table:
        table = sa.Table(name, self.metadata, *columns, **kw)
        self.bind.execute(sa.schema.CreateTable(table))
        return table

    def create_index(
        self, name: str, table: str, columns: list[str], schema: str | None = None, **kw: Any
    ) -> None:
        t = self.metadata.tables[f"{schema}.{table}" if schema else table]
        self.bind.execute(sa.schema.CreateIndex(sa.Index(name, *[t.c[c] for c in columns], **kw)))

    def drop_index(self, name: str, table_name: str, schema: str | None = None) -> None:
        t = self.metadata.tables[f"{schema}.{table_name}" if schema else table_name]
        index = next(i for i in t.indexes if i.name == name)
        self.bind.execute(sa.schema.DropIndex(index))

    def drop_table(self, name: str, schema: str | None = None) -> None:
        self.bind.execute(sa.schema.DropTable(self.metadata.tables[name]))
        self.metadata.remove(self.metadata.tables[name])

    def add_column(self, table: str, column: sa.Column[Any], schema: str | None = None) -> None:
        t = self.metadata.tables[f"{schema}.{table}" if schema else table]
        t.append_column(column)
        self.bind.execute(AddColumn(t, column))

    def drop_column(self, table: str, column: str, schema: str | None = None) -> None:
        t = self.metadata.tables[f"{schema}.{table}" if schema else table]
        self.bind.execute(sa.text(f"ALTER TABLE {t.name} DROP COLUMN {column}"))


#: The Alembic revisions in docs/, in their order: together, ``outbox install``.
REVISIONS = ("alembic_example", "alembic_key_partitions", "alembic_presence")


class Revisions:
    """The example revisions, upgraded in order and downgraded in reverse."""

    def __init__(self, modules: list[Any]) -> None:
        self.modules = modules
        self.op = modules[0].op

    def upgrade(self) -> None:
        for module in self.modules:
            module.upgrade()

    def downgrade(self) -> None:
        for module in reversed(self.modules):
            module.downgrade()


def load_example(fake_op: FakeOp, monkeypatch: pytest.MonkeyPatch) -> Revisions:
    alembic = types.ModuleType("alembic")
    alembic.op = fake_op  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "alembic", alembic)
    return Revisions([_load(name) for name in REVISIONS])


def _load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, ROOT / f"docs/{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def upgraded_ddl(dialect: str) -> set[str]:
    """The toolkit's DDL as the two revisions write it: the partition column added by ALTER."""
    tables = OutboxTables.create()
    engine_dialect = sa.create_mock_engine(sa.engine.URL.create(dialect), lambda *a: None).dialect
    column = tables.outbox.c.key_partition
    added = _normal(str(AddColumn(tables.outbox, column).compile(dialect=engine_dialect)))
    declared = _normal(str(sa.schema.CreateColumn(column).compile(dialect=engine_dialect)))
    out = set()
    for statement in _statements(tables.ddl(dialect)):
        out.add(
            statement.replace(f", {declared}", "")
            if "CREATE TABLE outbox (" in statement
            else statement
        )
    return out | {added}


class Recorder:
    def __init__(self, dialect: sa.Dialect) -> None:
        self.dialect = dialect
        self.statements: list[str] = []

    def execute(self, ddl: Any) -> None:
        self.statements.append(_normal(str(ddl.compile(dialect=self.dialect))))


@pytest.mark.parametrize("dialect", ["postgresql", "mysql", "mssql", "sqlite"])
def test_alembic_example_produces_the_toolkit_ddl(
    dialect: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine_dialect = sa.create_mock_engine(sa.engine.URL.create(dialect), lambda *a: None).dialect
    recorder = Recorder(engine_dialect)
    module = load_example(FakeOp(recorder, engine_dialect), monkeypatch)
    module.upgrade()
    assert set(recorder.statements) == upgraded_ddl(dialect)
    assert len(recorder.statements) == len(set(recorder.statements))
    if dialect == "postgresql":
        assert (
            "CREATE INDEX ix_outbox_pending ON outbox (id) WHERE state = 0" in recorder.statements
        )


def test_alembic_example_upgrade_and_downgrade_on_live_sqlite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    example = sa.create_engine(f"sqlite:///{tmp_path / 'alembic.db'}")
    toolkit = sa.create_engine(f"sqlite:///{tmp_path / 'toolkit.db'}")
    OutboxTables.create().create_all(toolkit)
    with example.begin() as conn:
        module = load_example(FakeOp(conn, example.dialect), monkeypatch)
        module.upgrade()

    def shape(engine: sa.Engine) -> dict[str, Any]:
        inspector = sa.inspect(engine)
        return {
            name: (
                [(c["name"], str(c["type"]), c["nullable"]) for c in inspector.get_columns(name)],
                sorted(
                    (i["name"], i["column_names"], i["unique"]) for i in inspector.get_indexes(name)
                ),
            )
            for name in inspector.get_table_names()
        }

    assert shape(example) == shape(toolkit)
    # The example's table works with the toolkit: enqueue and migrate into it.
    source = Outbox(toolkit)
    produce(source, 5)
    assert migrate(source, Outbox(example)).copied == 5
    with example.begin() as conn:
        module.op.bind = conn
        module.downgrade()
    assert sa.inspect(example).get_table_names() == []
    example.dispose()
    toolkit.dispose()


def test_alembic_example_with_real_alembic(tmp_path: Path) -> None:
    pytest.importorskip("alembic")
    from alembic.migration import MigrationContext  # type: ignore[import-not-found, unused-ignore]
    from alembic.operations import Operations  # type: ignore[import-not-found, unused-ignore]

    module = Revisions([_load(name) for name in REVISIONS])
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'real.db'}")
    with engine.begin() as conn, Operations.context(MigrationContext.configure(conn)):
        module.upgrade()
    with engine.connect() as conn:
        stored = conn.execute(
            sa.text(
                "SELECT sql FROM sqlite_master WHERE sql IS NOT NULL AND name NOT LIKE 'sqlite_%'"
            )
        ).scalars()
        # SQLite keeps an added column's text where ALTER put it.
        assert {_normal(s.replace(", key_partition SMALLINT)", ")")) for s in stored} | {
            "ALTER TABLE outbox ADD key_partition SMALLINT"
        } == upgraded_ddl("sqlite")
    with engine.begin() as conn, Operations.context(MigrationContext.configure(conn)):
        module.downgrade()
    assert sa.inspect(engine).get_table_names() == []
    engine.dispose()


def test_timestamps_bound_per_backend() -> None:
    aware = datetime(2024, 1, 1, 14, 0, tzinfo=UTC) + timedelta(microseconds=5)
    e = event(created_at=aware.replace(tzinfo=None), available_at=NOW)
    values = e.target_values(PG.dialect)
    assert values["created_at"] == aware and values["created_at"].tzinfo is not None
    assert e.target_values(MYSQL.dialect)["created_at"].tzinfo is None
