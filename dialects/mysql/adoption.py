"""Adopting a team's table on MySQL and MariaDB: one ``ALTER TABLE``, all or nothing.

Their DDL is not transactional: each statement commits on its own, so a
change made of several statements can stop half done. The whole adoption
is one ``ALTER TABLE`` (every column and index), which InnoDB applies
entirely or not at all, after :meth:`~.Adoption.plan` checked everything.
"""

from __future__ import annotations

from typing import Any, ClassVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox_core.dialects.base.adoption import Adoption, AdoptionPlan
from outbox_core.errors import AdoptionRefused


class MysqlAdoption(Adoption):
    """An ``AUTO_INCREMENT`` column with its unique key, UTC expression defaults."""

    #: ``DATETIME(6)`` holds UTC: ``CURRENT_TIMESTAMP`` would follow the writer's
    #: session time zone (MySQL 8.0.13+ and MariaDB take expression defaults).
    now_default: ClassVar[str | None] = "(UTC_TIMESTAMP(6))"
    id_definition: ClassVar[str | None] = "BIGINT NOT NULL AUTO_INCREMENT"

    def plan(self, conn: Connection, *, partial_indexes: bool) -> AdoptionPlan:
        """The base checks, and: InnoDB, and no other auto-numbered column (one per table)."""
        plan = super().plan(conn, partial_indexes=partial_indexes)
        t = self.table
        engine = conn.execute(
            sa.text(
                "SELECT ENGINE FROM information_schema.TABLES "
                "WHERE TABLE_SCHEMA = COALESCE(:schema, DATABASE()) AND TABLE_NAME = :name"
            ),
            {"schema": t.schema, "name": t.name},
        ).scalar()
        problems = []
        if str(engine).upper() != "INNODB":
            problems.append(f"its engine is {engine}: the outbox needs InnoDB's row locks")
        if plan.adds_id:
            other = conn.execute(
                sa.text(
                    "SELECT COLUMN_NAME FROM information_schema.COLUMNS "
                    "WHERE TABLE_SCHEMA = COALESCE(:schema, DATABASE()) AND TABLE_NAME = :name "
                    "AND EXTRA LIKE '%auto_increment%'"
                ),
                {"schema": t.schema, "name": t.name},
            ).scalar()
            if other is not None:
                problems.append(
                    f"{other} is already its AUTO_INCREMENT column (one per table): map id={other}"
                )
        if problems:
            raise AdoptionRefused(
                f"cannot adopt table {t.name} (nothing was changed): " + "; ".join(problems)
            )
        return plan

    def apply(self, conn: Connection, plan: AdoptionPlan, *, existing_sent: bool) -> None:
        """One ``ALTER TABLE`` with every column and index, then the existing rows' state.

        Rows written between the two are marked sent too when ``existing_sent``:
        the tool the table comes from must still run until the adoption ends.
        """
        if plan.empty:
            return
        preparer = conn.dialect.identifier_preparer
        clauses = [
            f"ADD COLUMN {preparer.quote(name)} {definition}" for name, definition in plan.columns
        ]
        clauses += [self._add_index(preparer, index) for index in plan.indexes]
        if conn.in_transaction():
            conn.commit()
        conn.execute(
            sa.DDL(  # type: ignore[no-untyped-call]
                f"ALTER TABLE {preparer.format_table(self.table)} " + ", ".join(clauses)
            )
        )
        conn.commit()
        if existing_sent:
            with self.sql.transaction(conn):
                self.mark_existing_sent(conn)

    @staticmethod
    def _add_index(preparer: Any, index: sa.Index) -> str:
        columns = ", ".join(preparer.quote(c.name) for c in index.columns)
        kind = "UNIQUE INDEX" if index.unique else "INDEX"
        return f"ADD {kind} {preparer.quote(str(index.name))} ({columns})"
