"""The caller's own event ids (issue #38): the accepted forms, the statements, the errors.

No database here: the statements ``enqueue`` runs are recorded by a port and
compiled for each family; the duplicate errors are the texts each database's
drivers raise. ``tests/contract/test_event_ids.py`` runs the same on the real
databases and brokers.
"""

from __future__ import annotations

import pickle
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa

from outbox_core.dialects.base import Dialect, get_dialect
from outbox_core.enqueue import Producer
from outbox_core.errors import DuplicateEventId, EventError, InvalidEventId
from outbox_core.message import NewEvent, build_new_event, check_event_id
from outbox_core.schema import OutboxTables

CANONICAL = "0b7c6f2e-5a1d-4c1e-9a57-3f1d2c4b5a69"
FAMILIES = ("sqlite", "postgresql", "mysql", "mssql")


# -- the accepted forms ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "given",
    [
        CANONICAL,
        CANONICAL.upper(),
        CANONICAL.replace("-", ""),
        CANONICAL.replace("-", "").upper(),
        "0B7C6F2E-5a1d-4C1E-9a57-3F1D2C4B5A69",
        uuid.UUID(CANONICAL),
    ],
)
def test_a_uuid_or_its_text_becomes_the_lower_case_hyphenated_id(given: Any) -> None:
    assert check_event_id(given) == CANONICAL
    event = build_new_event("t", {}, event_id=given)
    assert (event.event_id, event.id_given) == (CANONICAL, True)


@pytest.mark.parametrize(
    "given",
    [
        "",
        "not-a-uuid",
        "{" + CANONICAL + "}",
        "urn:uuid:" + CANONICAL,
        " " + CANONICAL,
        CANONICAL + "\n",
        CANONICAL[:-1],
        CANONICAL + "0",
        CANONICAL.replace("-", "")[:8] + "-" + CANONICAL.replace("-", "")[8:],  # hyphens misplaced
        CANONICAL.replace("a", "g"),
        "\uff10" * 32,  # full-width digits
        uuid.UUID(CANONICAL).int,
        uuid.UUID(CANONICAL).bytes,
        True,
        None,
        ["x"],
    ],
)
def test_anything_else_is_refused_with_the_toolkits_error(given: Any) -> None:
    with pytest.raises(InvalidEventId, match="event_id") as caught:
        check_event_id(given)
    assert isinstance(caught.value, EventError) and isinstance(caught.value, ValueError)
    assert "uuid.UUID" in str(caught.value)


def test_a_long_bad_id_is_shortened_in_the_message() -> None:
    with pytest.raises(InvalidEventId) as caught:
        check_event_id("x" * 10_000)
    assert len(str(caught.value)) < 500


def test_without_an_id_the_event_gets_a_new_random_one() -> None:
    first, second = build_new_event("t", {}), build_new_event("t", {})
    assert not first.id_given and not second.id_given
    assert first.event_id != second.event_id
    assert uuid.UUID(first.event_id).version == 4


def test_duplicate_event_id_is_an_event_error_naming_the_ids_and_survives_pickling() -> None:
    error = DuplicateEventId(f"event_id {CANONICAL!r} is already in the table", (CANONICAL,))
    assert isinstance(error, EventError)
    copy = pickle.loads(pickle.dumps(error))
    assert (str(copy), copy.event_ids) == (str(error), (CANONICAL,))


# -- the statements -------------------------------------------------------------------------


class RecordingPort:
    """A transaction port that records what ``enqueue`` runs (bind None, no autocommit)."""

    def __init__(self, driver: sa.Dialect, fail: Callable[[sa.Executable], None] | None = None):
        self.driver = driver
        self.bind = None
        self.ran: list[tuple[sa.Executable, Any]] = []
        self.fail = fail

    def autocommit(self) -> bool:
        return False

    def first_event(self, owner: object) -> bool:
        return True

    def execute(self, statement: sa.Executable, parameters: Any) -> None:
        self.ran.append((statement, parameters))
        if self.fail is not None:
            self.fail(statement)

    def after_commit(self, callback: Callable[[], None]) -> None:
        pass

    def sql(self) -> list[str]:
        return [sql_of(s, self.driver) for s, _ in self.ran]


def sql_of(statement: sa.Executable, driver: sa.Dialect) -> str:
    return " ".join(str(statement.compile(dialect=driver)).split())  # type: ignore[attr-defined]


def producer_for(name: str) -> Producer:
    dialect: Dialect = get_dialect(name)(OutboxTables.create("events"))

    def no_engine() -> Any:
        raise AssertionError("no database in unit tests")

    producer = Producer(dialect, fallback=no_engine)
    producer.check = lambda port, event: None  # type: ignore[method-assign]
    return producer


def without_clock(params: dict[str, Any]) -> dict[str, Any]:
    """The parameters but SQLite's application clock (bound at each call)."""
    return {k: v for k, v in params.items() if k != "o_now"}


def driver_of(name: str) -> sa.Dialect:
    return sa.create_mock_engine(sa.make_url(f"{name}://"), lambda *a, **k: None).dialect


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("notify", [False, True])
def test_without_a_caller_id_enqueue_runs_one_insert_as_before(name: str, notify: bool) -> None:
    producer = producer_for(name)
    port = RecordingPort(driver_of(name))
    event = build_new_event("t", {"a": 1}, key="k")
    producer.enqueue(port, event, notify=notify)
    expected, params = producer.dialect.enqueue.call(event, notify=notify)
    assert len(port.ran) == 1
    assert port.ran[0][0] is expected  # the cached statement of the generated path
    assert without_clock(port.ran[0][1]) == without_clock(params)


GUARDED = {
    "sqlite": [
        "DELETE FROM events WHERE 0 = 1",
        "SAVEPOINT outbox_event_id",
        "INSERT",
        "RELEASE SAVEPOINT outbox_event_id",
    ],
    "postgresql": ["SAVEPOINT outbox_event_id", "INSERT", "RELEASE SAVEPOINT outbox_event_id"],
    "mysql": ["SAVEPOINT outbox_event_id", "INSERT", "RELEASE SAVEPOINT outbox_event_id"],
    "mssql": ["SAVE TRANSACTION outbox_event_id", "INSERT"],
}


@pytest.mark.parametrize("name", FAMILIES)
def test_with_a_caller_id_the_same_insert_runs_inside_a_savepoint(name: str) -> None:
    producer = producer_for(name)
    driver = driver_of(name)
    port = RecordingPort(driver)
    event = build_new_event("t", {"a": 1}, key="k", event_id=CANONICAL)
    producer.enqueue(port, event, notify=False)
    got = port.sql()
    insert, params = producer.dialect.enqueue.call(event, notify=False)
    assert [s if not s.startswith("INSERT") else "INSERT" for s in got] == GUARDED[name]
    assert got[GUARDED[name].index("INSERT")] == sql_of(insert, driver)
    inserted = port.ran[GUARDED[name].index("INSERT")][1]
    assert without_clock(inserted) == without_clock(params)
    assert inserted["o_event_id"] == CANONICAL


def test_the_wake_up_goes_before_the_savepoint_on_postgresql() -> None:
    """Undone with a duplicate, a wake-up inside the savepoint would be missing while the
    transaction's mark says it was sent."""
    producer = producer_for("postgresql")
    port = RecordingPort(driver_of("postgresql"))
    producer.enqueue(port, build_new_event("t", {}, event_id=CANONICAL), notify=True)
    got = port.sql()
    assert got[0].startswith("SELECT pg_notify(")
    assert got[1] == "SAVEPOINT outbox_event_id"
    assert "pg_notify" not in got[2]  # the insert alone


@pytest.mark.parametrize("name", FAMILIES)
def test_enqueue_many_with_one_caller_id_puts_every_insert_in_the_savepoint(name: str) -> None:
    producer = producer_for(name)
    port = RecordingPort(driver_of(name))
    events = [build_new_event("t", {"n": n}) for n in range(3)]
    events.append(build_new_event("t", {"n": 3}, event_id=CANONICAL))
    producer.enqueue_many(port, events, notify=False)
    got = port.sql()
    begin = got.index(GUARDED[name][-2] if name == "mssql" else "SAVEPOINT outbox_event_id")
    inserts = [i for i, s in enumerate(got) if s.startswith("INSERT")]
    assert inserts and all(i > begin for i in inserts)
    if name != "mssql":
        assert got[-1] == "RELEASE SAVEPOINT outbox_event_id"


@pytest.mark.parametrize("name", FAMILIES)
def test_enqueue_many_without_caller_ids_runs_as_before(name: str) -> None:
    producer = producer_for(name)
    driver = driver_of(name)
    port = RecordingPort(driver)
    events = [build_new_event("t", {"n": n}, key="k") for n in range(4)]
    producer.enqueue_many(port, events, notify=False)
    expected = list(producer.dialect.enqueue.many_calls(events, notify=False, driver=driver))
    assert port.sql() == [sql_of(s, driver) for s, _ in expected]
    assert not any("SAVE" in s for s in port.sql())


# -- duplicates: which errors are ----------------------------------------------------------


class FakeDriverError(Exception):
    """A driver error carrying what asyncpg and psycopg carry beside the message."""

    def __init__(self, message: str, **attributes: Any) -> None:
        super().__init__(message)
        for name, value in attributes.items():
            setattr(self, name, value)


DUPLICATES = {
    "postgresql": FakeDriverError(
        'duplicate key value violates unique constraint "ux_events_event_id"\n'
        f"DETAIL:  Key (event_id)=({CANONICAL}) already exists."
    ),
    "asyncpg": FakeDriverError(
        'duplicate key value violates unique constraint "ux_events_event_id"',
        detail=f"Key (event_id)=({CANONICAL}) already exists.",
        constraint_name="ux_events_event_id",
    ),
    "mariadb": FakeDriverError(
        f"(1062, \"Duplicate entry '{CANONICAL}' for key 'ux_events_event_id'\")"
    ),
    "mysql8": FakeDriverError(
        f"(1062, \"Duplicate entry '{CANONICAL}' for key 'events.ux_events_event_id'\")"
    ),
    "mssql": FakeDriverError(
        "('23000', \"[23000] [Microsoft][ODBC Driver 18 for SQL Server][SQL Server]Cannot insert "
        "duplicate key row in object 'dbo.events' with unique index 'ux_events_event_id'. The "
        f'duplicate key value is ({CANONICAL}). (2601)")'
    ),
}


@pytest.mark.parametrize("where", list(DUPLICATES))
def test_a_duplicate_is_recognised_by_the_id_the_database_names(where: str) -> None:
    enqueue = get_dialect("postgresql")(OutboxTables.create("events")).enqueue
    other = str(uuid.uuid4())
    assert enqueue.duplicate_event_id(DUPLICATES[where], [other, CANONICAL]) == CANONICAL


def test_sqlite_names_the_column_not_the_id() -> None:
    enqueue = get_dialect("sqlite")(OutboxTables.create("events")).enqueue
    error = FakeDriverError("UNIQUE constraint failed: events.event_id")
    assert enqueue.duplicate_event_id(error, [CANONICAL]) == ""


def test_sqlalchemys_wrapper_is_read_through_to_the_driver_error() -> None:
    """The wrapper's text holds the statement's parameters (every id of a batch): only the
    driver's own error may name the duplicate."""
    enqueue = get_dialect("sqlite")(OutboxTables.create("events")).enqueue
    orig = FakeDriverError("UNIQUE constraint failed: events.event_id")
    wrapped = sa.exc.IntegrityError("INSERT INTO events ...", (CANONICAL,), orig)
    assert CANONICAL in str(wrapped)
    assert enqueue.duplicate_event_id(wrapped, [CANONICAL]) == ""


@pytest.mark.parametrize(
    "message",
    [
        'null value in column "topic" of relation "events" violates not-null constraint',
        'duplicate key value violates unique constraint "orders_pkey"',  # another table's key
        "UNIQUE constraint failed: orders.id",
        "(1062, \"Duplicate entry '7' for key 'PRIMARY'\")",
        "server closed the connection unexpectedly",
    ],
)
def test_other_errors_are_not_duplicates(message: str) -> None:
    for name in FAMILIES:
        enqueue = get_dialect(name)(OutboxTables.create("events")).enqueue
        assert enqueue.duplicate_event_id(FakeDriverError(message), [CANONICAL]) is None


# -- the undo -------------------------------------------------------------------------------


def _fail_on_insert(error: Exception) -> Callable[[sa.Executable], None]:
    def fail(statement: sa.Executable) -> None:
        if isinstance(statement, sa.Insert):
            raise error

    return fail


def test_a_duplicate_rolls_back_to_the_savepoint_and_raises_duplicate_event_id() -> None:
    producer = producer_for("postgresql")
    port = RecordingPort(driver_of("postgresql"), _fail_on_insert(DUPLICATES["postgresql"]))
    with pytest.raises(DuplicateEventId) as caught:
        producer.enqueue(port, build_new_event("t", {}, event_id=CANONICAL), notify=False)
    assert caught.value.event_ids == (CANONICAL,)
    assert CANONICAL in str(caught.value) and "still usable" in str(caught.value)
    assert caught.value.__cause__ is DUPLICATES["postgresql"]
    assert port.sql()[-2:] == [
        "ROLLBACK TO SAVEPOINT outbox_event_id",
        "RELEASE SAVEPOINT outbox_event_id",
    ]


def test_another_error_is_raised_as_it_is_after_the_savepoint_is_undone() -> None:
    producer = producer_for("postgresql")
    error = FakeDriverError("value too long for type character varying(255)")
    port = RecordingPort(driver_of("postgresql"), _fail_on_insert(error))
    with pytest.raises(FakeDriverError) as caught:
        producer.enqueue(port, build_new_event("t", {}, event_id=CANONICAL), notify=False)
    assert caught.value is error
    assert port.sql()[-1] == "RELEASE SAVEPOINT outbox_event_id"


def test_when_the_undo_fails_too_the_first_error_is_raised() -> None:
    producer = producer_for("postgresql")
    error = DUPLICATES["postgresql"]

    def fail(statement: sa.Executable) -> None:
        if not isinstance(statement, sa.sql.expression.SavepointClause):
            raise error if isinstance(statement, sa.Insert) else ConnectionError("gone")

    port = RecordingPort(driver_of("postgresql"), fail)
    with pytest.raises(FakeDriverError) as caught:
        producer.enqueue(port, build_new_event("t", {}, event_id=CANONICAL), notify=False)
    assert caught.value is error


def test_ids_repeated_in_one_enqueue_many_are_refused_before_any_statement() -> None:
    producer = producer_for("postgresql")
    port = RecordingPort(driver_of("postgresql"))
    specs = [
        {"topic": "t", "payload": {"n": 0}, "event_id": CANONICAL},
        {"topic": "t", "payload": {"n": 1}},
        {"topic": "t", "payload": {"n": 2}, "event_id": CANONICAL.upper()},
    ]
    with pytest.raises(DuplicateEventId, match=r"events\[2\].*events\[0\]") as caught:
        producer.build_many(port, specs)
    assert caught.value.event_ids == (CANONICAL,)
    assert port.ran == []


def test_a_bad_id_in_enqueue_many_names_its_position() -> None:
    producer = producer_for("postgresql")
    port = RecordingPort(driver_of("postgresql"))
    specs = [{"topic": "t", "payload": {}}, {"topic": "t", "payload": {}, "event_id": "nope"}]
    with pytest.raises(InvalidEventId, match=r"events\[1\]: event_id 'nope' is not a UUID"):
        producer.build_many(port, specs)
    assert port.ran == []


def test_new_event_defaults_keep_the_generated_path() -> None:
    event = NewEvent(event_id=CANONICAL, topic="t", payload={})
    assert event.id_given is False


def test_sql_server_rolls_back_to_its_savepoint_and_releases_nothing() -> None:
    """SQL Server has no RELEASE SAVEPOINT: ``SAVE TRANSACTION`` then, on a duplicate,
    ``ROLLBACK TRANSACTION <name>`` (which keeps the outer transaction open)."""
    producer = producer_for("mssql")
    error = FakeDriverError(str(DUPLICATES["mssql"]))
    port = RecordingPort(driver_of("mssql"), _fail_on_insert(error))
    with pytest.raises(DuplicateEventId) as caught:
        producer.enqueue(port, build_new_event("t", {}, event_id=CANONICAL), notify=False)
    assert caught.value.event_ids == (CANONICAL,)
    got = port.sql()
    assert got[0] == "SAVE TRANSACTION outbox_event_id"
    assert got[1].startswith("INSERT")
    assert got[2:] == ["ROLLBACK TRANSACTION outbox_event_id"]
