"""Adopting a team's own outbox table (``outbox install --columns``): a part of Dialect.

A table in another layout (Debezium's: ``id uuid``, ``aggregate_id``,
``event_type``, ``payload``) is relayed as it is. Its columns keep their
names (:class:`~outbox_core.schema.ColumnMap`); adopting it adds only what
the toolkit keeps for itself: ``state``, ``attempts``, ``available_at``,
the lease, ``sent_at``, ``last_error``, ``key_partition``, the auto-numbered
column that orders the table when it has none, ``created_at`` and
``headers`` when it lacks them, and the work indexes. Each added column has
a default, so the team's own INSERTs keep working unchanged: a row they
write is pending, due at once, its key's partition computed by the relay.

Everything is checked before any change (:meth:`Adoption.plan`): the
mapped columns exist with types the toolkit can read, no column it would
add is there with another meaning, ``event_id`` holds no duplicate. The
change is then made all or nothing: in one transaction where the database
rolls DDL back, in one ``ALTER TABLE`` statement on MySQL and MariaDB.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox_core.columns import BOOKKEEPING_COLUMNS, MAPPABLE_FIELDS, ColumnMap
from outbox_core.dialects.base.primitives import SqlPrimitives
from outbox_core.errors import AdoptionRefused, ConfigurationError, TableMissing
from outbox_core.message import State
from outbox_core.schema import built_on, in_state

#: Names other outbox layouts give each field, most likely first (Debezium's
#: outbox event router: ``id``, ``aggregateid`` / ``aggregate_id``, ``type`` /
#: ``event_type``, ``payload``).
LIKELY_NAMES: dict[str, tuple[str, ...]] = {
    "event_id": ("event_id", "id", "eventid", "uuid", "message_id"),
    "key": ("key", "aggregate_id", "aggregateid", "partition_key", "message_key"),
    # Debezium routes by aggregatetype unless told otherwise (route.by.field).
    "topic": ("topic", "event_type", "eventtype", "aggregatetype", "aggregate_type", "type"),
    "payload": ("payload", "data", "body", "message"),
    "headers": ("headers", "metadata"),
    "created_at": ("created_at", "timestamp", "occurred_at", "createdat", "occurredat"),
}

#: What an adopted table's existing rows become: still to publish, or already published
#: (by the tool the table comes from, which ran until the adoption).
EXISTING_ROWS = ("pending", "sent")


@dataclass
class AdoptionPlan:
    """What adopting the table adds: columns (``name``, SQL definition) and indexes."""

    columns: list[tuple[str, str]] = field(default_factory=list)
    indexes: list[sa.Index] = field(default_factory=list)
    #: ``id`` (the ordering column) is added by this plan.
    adds_id: bool = False

    @property
    def empty(self) -> bool:
        """Nothing to add: the table was adopted before."""
        return not self.columns and not self.indexes


class Adoption:
    """Checks a team's table and adds the toolkit's bookkeeping to it.

    A family overrides the class attributes (its clock default, its
    auto-numbered column) and, where its DDL is not transactional,
    :meth:`apply`.
    """

    #: A column default giving the database's current UTC time (None: the database
    #: cannot add a column with such a default to a table that has rows).
    now_default: ClassVar[str | None] = "CURRENT_TIMESTAMP"
    #: The definition of an added auto-numbered ``id`` after its name (None: cannot).
    id_definition: ClassVar[str | None] = None
    #: Why an ``id`` cannot be added here (the fix), when :attr:`id_definition` is None.
    id_refusal: ClassVar[str] = "map id= to the table's own auto-numbered column"

    def __init__(self, sql: SqlPrimitives) -> None:
        self.sql = sql
        self.tables = sql.tables
        self.table = sql.tables.outbox

    # -- checks ----------------------------------------------------------------

    def foreign_columns(self, conn: Connection) -> list[str] | None:
        """The required columns an existing table lacks (None: no such table).

        Not empty: the table is in another layout, and ``install`` without
        ``--columns`` would fail half way; :func:`guess_columns` suggests a map.
        """
        t = self.table
        inspector = sa.inspect(conn)
        if not inspector.has_table(t.name, schema=t.schema):
            return None
        present = {c["name"].lower() for c in inspector.get_columns(t.name, t.schema)}
        return [c.name for c in t.columns if not c.nullable and c.name.lower() not in present]

    def refuse_another_layout(self, conn: Connection) -> None:
        """:class:`AdoptionRefused` when the table exists in another layout, with the
        ``--columns`` to try (plain ``install`` would fail half way on it)."""
        missing = self.foreign_columns(conn)
        if not missing:
            return
        guess = guess_columns(self.present_columns(conn))
        hint = (
            f"relay it as it is with --columns {guess}"
            if guess is not None
            else "relay it as it is with --columns FIELD=COLUMN,... naming its event id, "
            "topic and payload columns"
        )
        raise AdoptionRefused(
            f"table {self.table.name} exists in another layout (no column(s) "
            f"{', '.join(missing)}); nothing was changed: {hint}"
        )

    def unfilled_columns(self, conn: Connection) -> list[str]:
        """The table's own columns a row needs a value for that the toolkit cannot give.

        ``NOT NULL`` without a default (Debezium's ``aggregate_type``): the team's
        INSERTs fill them, ``enqueue`` and a log-tailing relay's write-back of a
        row the team deleted cannot.
        """
        t = self.table
        ours = {c.name.lower() for c in t.columns}
        return [
            c["name"]
            for c in sa.inspect(conn).get_columns(t.name, t.schema)
            if c["name"].lower() not in ours
            and not c.get("nullable", True)
            and c.get("default") is None
            and c.get("autoincrement") is not True
            and c.get("computed") is None
        ]

    def present_columns(self, conn: Connection) -> dict[str, Any]:
        """The table's columns: lower-case name -> reflected type."""
        t = self.table
        columns = sa.inspect(conn).get_columns(t.name, t.schema)
        return {c["name"].lower(): c["type"] for c in columns}

    def plan(self, conn: Connection, *, partial_indexes: bool) -> AdoptionPlan:
        """What adopting the table adds; :class:`AdoptionRefused` listing every problem.

        Reads the table's definition only: nothing is changed.
        """
        t = self.table
        inspector = sa.inspect(conn)
        if not inspector.has_table(t.name, schema=t.schema):
            raise TableMissing(
                f"table {t.name} does not exist: --columns adopts an existing table (create "
                "it first, or leave --columns out to create the toolkit's own)"
            )
        present = {c["name"].lower(): c for c in inspector.get_columns(t.name, t.schema)}
        problems: list[str] = []
        plan = AdoptionPlan()
        mapping = self.tables.columns
        for key in ("event_id", "topic", "key", "payload"):
            column = t.c[key]
            found = present.get(column.name.lower())
            if found is None:
                problems.append(f"{key}={column.name}: no column {column.name}")
            else:
                problems += self._type_problems(key, column.name, found["type"])
        for key in ("headers", "created_at"):
            column = t.c[key]
            found = present.get(column.name.lower())
            if found is not None:
                problems += self._type_problems(key, column.name, found["type"])
            elif getattr(mapping, key) != key:
                problems.append(f"{key}={column.name}: no column {column.name}")
            else:
                plan.columns.append((column.name, self.definition(conn, column)))
        problems += self._id_plan(conn, present, plan)
        for name in sorted(BOOKKEEPING_COLUMNS):
            column = t.c[name]
            found = present.get(name)
            if found is None:
                plan.columns.append((name, self.definition(conn, column)))
            elif not _same_kind(found["type"], column.type):
                problems.append(
                    f"column {name} is already there as {found['type']}: the toolkit keeps a "
                    f"{column.type.compile(dialect=conn.dialect)} of that name for itself"
                )
        if problems:
            raise AdoptionRefused(
                f"cannot adopt table {t.name} (nothing was changed): " + "; ".join(problems)
            )
        plan.indexes = self._missing_indexes(conn, inspector, partial_indexes, plan)
        return plan

    def _type_problems(self, key: str, name: str, found: Any) -> list[str]:
        """The mapped column's type is one the toolkit reads for ``key``."""
        if key in ("event_id", "topic", "key"):
            ok = isinstance(found, sa.String | sa.Uuid) or type(found).__name__.upper() in (
                "UUID",
                "UNIQUEIDENTIFIER",
            )
        elif key in ("payload", "headers"):
            ok = (
                isinstance(found, sa.JSON | sa.String | sa.Text)
                or "JSON" in type(found).__name__.upper()
            )
        else:  # created_at
            ok = isinstance(found, sa.DateTime)
        if ok:
            return []
        wanted = {
            "event_id": "a UUID or text",
            "topic": "text",
            "key": "text",
            "payload": "JSON or text",
            "headers": "JSON or text",
            "created_at": "a timestamp (UTC)",
        }[key]
        return [f"{key}={name}: {name} is {found}, not {wanted}"]

    def _id_plan(self, conn: Connection, present: dict[str, Any], plan: AdoptionPlan) -> list[str]:
        """The ordering column: the table's own auto-numbered one, or one to add."""
        column = self.table.c.id
        found = present.get(column.name.lower())
        if found is not None:
            if not isinstance(found["type"], sa.Integer):
                return [
                    f"id={column.name}: {column.name} is {found['type']}, not an auto-numbered "
                    "integer (map event_id= to it, and the toolkit adds its own)"
                ]
            return []
        if self.id_definition is None:
            return [f"cannot add an auto-numbered {column.name} here: {self.id_refusal}"]
        plan.columns.append((column.name, self.id_definition))
        plan.adds_id = True
        return []

    def definition(self, conn: Connection, column: sa.Column[Any]) -> str:
        """The SQL definition of an added column after its name, with its default."""
        kind = column.type.compile(dialect=conn.dialect)
        default: str | None = None
        if column.server_default is not None:
            default = str(getattr(column.server_default, "arg", "")) or None
        elif not column.nullable:
            # available_at, created_at: rows the team writes are due at once.
            if self.now_default is None:
                raise AdoptionRefused(
                    f"cannot adopt table {self.table.name} (nothing was changed): "
                    f"{column.name} cannot be added with the current time as its default "
                    f"here; map {column.key}= to a column of the table"
                )
            default = self.now_default
        text = kind + ("" if column.nullable else " NOT NULL")
        return text + (f" DEFAULT {default}" if default is not None else "")

    def _missing_indexes(
        self,
        conn: Connection,
        inspector: sa.Inspector,
        partial_indexes: bool,
        plan: AdoptionPlan,
    ) -> list[sa.Index]:
        t = self.table
        names = {ix["name"] for ix in inspector.get_indexes(t.name, schema=t.schema)}
        unique_sets = {
            tuple(c.lower() for c in ix["column_names"] if c)
            for ix in inspector.get_indexes(t.name, schema=t.schema)
            if ix.get("unique")
        }
        unique_sets |= {
            tuple(c.lower() for c in uc["column_names"])
            for uc in inspector.get_unique_constraints(t.name, schema=t.schema)
        }
        pk = inspector.get_pk_constraint(t.name, schema=t.schema)
        unique_sets.add(tuple(c.lower() for c in pk.get("constrained_columns") or []))
        wanted: list[sa.Index] = []
        for index in sorted(t.indexes, key=lambda i: str(i.name)):
            if index.name in names or not built_on(index, partial_indexes):
                continue
            columns = tuple(c.name.lower() for c in index.columns)
            if index.unique and columns in unique_sets:
                continue  # the event id is the table's key already (Debezium's id)
            if index.unique:
                self._check_unique(conn, index)
            wanted.append(index)
        if (t.c.id.name.lower(),) not in unique_sets:
            # On a copy of the table: an index built on ``t`` would join its definition.
            copy = sa.Table(
                t.name, sa.MetaData(), sa.Column(t.c.id.name, sa.BigInteger()), schema=t.schema
            )
            wanted.append(sa.Index(f"ux_{t.name}_id", copy.c[t.c.id.name], unique=True))
        return wanted

    def _check_unique(self, conn: Connection, index: sa.Index) -> None:
        column = next(iter(index.columns))
        total, distinct = conn.execute(
            sa.select(sa.func.count(column), sa.func.count(sa.distinct(column)))
        ).one()
        if int(total) != int(distinct):
            raise AdoptionRefused(
                f"cannot adopt table {self.table.name} (nothing was changed): "
                f"{column.name} holds {int(total) - int(distinct)} duplicate value(s); the "
                "toolkit needs each event id once"
            )

    # -- the change ------------------------------------------------------------

    def adopt(self, conn: Connection, *, existing: str, partial_indexes: bool) -> None:
        """Check the table, add the bookkeeping, then create the companion tables.

        The rows already there stay pending or, ``existing="sent"``, become
        sent: only when this call adds the bookkeeping (a rerun marks no row).
        """
        if existing not in EXISTING_ROWS:
            raise ConfigurationError(
                f"existing must be one of {', '.join(EXISTING_ROWS)}, not {existing!r}"
            )
        plan = self.plan(conn, partial_indexes=partial_indexes)
        if conn.in_transaction():
            conn.commit()
        adds_state = any(name == "state" for name, _ in plan.columns)
        self.apply(conn, plan, existing_sent=existing == "sent" and adds_state)
        with self.sql.transaction(conn):
            self.tables.create_all(conn, self.tables.companions)

    def apply(self, conn: Connection, plan: AdoptionPlan, *, existing_sent: bool) -> None:
        """Make the change in one transaction (the database rolls DDL back).

        ``existing_sent``: the rows already there become sent, in the same
        transaction, whose ``ALTER TABLE`` keeps new rows out until it commits.
        """
        with self.sql.transaction(conn):
            for name, definition in plan.columns:
                conn.execute(self.add_column(conn, name, definition))
            for index in plan.indexes:
                index.create(conn)
            if existing_sent:
                self.mark_existing_sent(conn)

    def add_column(self, conn: Connection, name: str, definition: str) -> sa.ExecutableDDLElement:
        """``ALTER TABLE <t> ADD <name> <definition>``."""
        preparer = conn.dialect.identifier_preparer
        return sa.DDL(  # type: ignore[no-untyped-call]
            f"ALTER TABLE {preparer.format_table(self.table)} "
            f"ADD {preparer.quote(name)} {definition}"
        )

    def mark_existing_sent(self, conn: Connection) -> int:
        """Every row still pending becomes sent: it was published before the adoption.

        Run in the adoption's transaction, right after the columns were added.
        """
        t = self.table
        result = conn.execute(
            sa.update(t)
            .where(in_state(t.c.state, State.PENDING))
            .values(state=int(State.SENT), sent_at=self.sql.now())
        )
        return int(result.rowcount or 0)


def _same_kind(found: Any, wanted: sa.types.TypeEngine[Any]) -> bool:
    """A column already there is the toolkit's own (a rerun), not another of that name."""
    for kind in (sa.Integer, sa.DateTime, sa.String):
        if isinstance(wanted, kind):
            return isinstance(found, kind)
    return True


def guess_columns(present: dict[str, Any]) -> ColumnMap | None:
    """A :class:`ColumnMap` naming columns of ``present`` (lower-case name -> type), or None.

    Each field takes the first of its :data:`LIKELY_NAMES` the table has and
    no other field took; None when ``event_id``, ``topic`` or ``payload``
    finds none. A guess: ``outbox install --columns`` checks it.
    """
    chosen: dict[str, str] = {}
    taken: set[str] = set()
    for wanted in ("event_id", "payload", "key", "topic", "headers", "created_at"):
        for name in LIKELY_NAMES[wanted]:
            if name in present and name not in taken:
                chosen[wanted] = name
                taken.add(name)
                break
    if not {"event_id", "topic", "payload"} <= set(chosen):
        return None
    if "id" not in chosen and "id" in present and "id" not in taken:
        chosen["id"] = "id"
    try:
        return ColumnMap.parse({f: c for f, c in chosen.items() if f in MAPPABLE_FIELDS})
    except ConfigurationError:
        return None
