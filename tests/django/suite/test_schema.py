"""``manage.py migrate`` creates exactly what ``outbox install`` creates; doctor agrees."""

from __future__ import annotations

import json
from typing import Any

import pytest
import sqlalchemy as sa
from django.core.management import call_command
from django.db import connections

from outbox_core import Outbox
from outbox_core.contrib.django import outbox_for
from outbox_core.contrib.django.databases import database_url
from tests.django.suite.conftest import manage

pytestmark = pytest.mark.django_db(transaction=True)


def _options(options: dict[str, Any]) -> dict[str, str]:
    return {k: str(getattr(v, "text", v)) for k, v in sorted(options.items())}


def _shape(inspector: Any, table: str, prefix: str) -> dict[str, Any]:
    """Columns and indexes of ``table``, index names with the table's prefix cut out."""
    columns = [
        (c["name"], str(c["type"]), c["nullable"], str(c.get("default")).replace(prefix, "<t>"))
        for c in inspector.get_columns(table)
    ]
    indexes = sorted(
        (
            ix["name"].replace(prefix, "<t>"),
            tuple(ix["column_names"]),
            bool(ix["unique"]),
            str(_options(ix.get("dialect_options", {}))).replace(prefix, "<t>"),
        )
        for ix in inspector.get_indexes(table)
    )
    pk = inspector.get_pk_constraint(table)["constrained_columns"]
    return {"columns": columns, "indexes": indexes, "pk": pk}


def test_migrate_creates_what_outbox_install_creates() -> None:
    url = database_url("default")
    reference = Outbox(url, table="obx_dj_ref")
    reference.install()
    try:
        inspector = sa.inspect(reference.engine)
        assert _shape(inspector, "outbox", "outbox") == _shape(
            inspector, "obx_dj_ref", "obx_dj_ref"
        )
        assert _shape(inspector, "outbox_inbox", "outbox_inbox") == _shape(
            inspector, "obx_dj_ref_inbox", "obx_dj_ref_inbox"
        )
    finally:
        reference.tables.metadata.drop_all(reference.engine)
        reference.dispose()


def test_outbox_doctor_finds_nothing_missing_or_obsolete() -> None:
    result = manage("outbox", "doctor", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["summary"]["error"] == 0
    by_check = {f["check"]: f for f in report["findings"]}
    assert by_check["tables"]["severity"] == "ok"
    assert by_check["index"]["severity"] == "ok", by_check["index"]


def test_migrating_back_drops_the_tables_and_forward_creates_them_again() -> None:
    outbox = outbox_for()
    call_command("migrate", "outbox_toolkit", "zero", verbosity=0)
    try:
        names = connections["default"].introspection.table_names()
        assert "outbox" not in names and "outbox_inbox" not in names
    finally:
        call_command("migrate", "outbox_toolkit", verbosity=0)
    assert {"outbox", "outbox_inbox"} <= set(connections["default"].introspection.table_names())
    outbox.check()  # the toolkit finds its table
