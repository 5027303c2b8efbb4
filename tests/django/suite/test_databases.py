"""Multiple databases (using=, routers, the system check) and URLs built from DATABASES."""

from __future__ import annotations

import os
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import connections, transaction
from django.test import override_settings

from outbox_core.contrib.django import outbox
from outbox_core.contrib.django.checks import check_outbox_database
from outbox_core.contrib.django.conf import outbox_settings
from outbox_core.contrib.django.databases import database_url
from outbox_core.contrib.django.models import OutboxEvent
from outbox_core.errors import ConfigurationError
from tests.django.suite.conftest import manage

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")


class ToOther:
    """Routes the outbox app to the "other" database."""

    def db_for_write(self, model: Any, **hints: Any) -> str | None:
        return "other" if model._meta.app_label == "outbox_toolkit" else None

    db_for_read = db_for_write


ROUTER = f"{__name__}.ToOther"


def test_using_writes_in_that_databases_atomic_block() -> None:
    with transaction.atomic(using="other"):
        outbox.enqueue("t.other", {"n": 1}, using="other")
    with transaction.atomic():
        outbox.enqueue("t.default", {"n": 2})
    assert list(OutboxEvent.objects.using("other").values_list("topic", flat=True)) == ["t.other"]
    assert list(OutboxEvent.objects.using("default").values_list("topic", flat=True)) == [
        "t.default"
    ]
    # An atomic block on another database is no transaction for this one.
    with transaction.atomic(using="default"), pytest.raises(ConfigurationError, match="'other'"):
        outbox.enqueue("t", {}, using="other")
    with pytest.raises(ConfigurationError, match="'nope' is not in DATABASES"):
        outbox.enqueue("t", {}, using="nope")


def test_the_router_chooses_the_database() -> None:
    with override_settings(DATABASE_ROUTERS=[ROUTER]):
        with transaction.atomic(using="other"):
            outbox.enqueue("t.routed", {"n": 1})
        with transaction.atomic(using="other"):
            outbox.enqueue_many([{"topic": "t.many", "payload": {}}])
    assert sorted(OutboxEvent.objects.using("other").values_list("topic", flat=True)) == [
        "t.many",
        "t.routed",
    ]
    assert OutboxEvent.objects.using("default").count() == 0


def test_settings_database_is_the_default_without_a_router() -> None:
    with override_settings(OUTBOX={"DATABASE": "other"}), transaction.atomic(using="other"):
        outbox.enqueue("t.setting", {"n": 1})
    assert OutboxEvent.objects.using("other").count() == 1


def test_system_check_reports_a_router_disagreeing_with_settings() -> None:
    with override_settings(DATABASE_ROUTERS=[ROUTER], OUTBOX={"DATABASE": "default"}):
        errors = check_outbox_database()
    assert [e.id for e in errors] == ["outbox.E002"]
    assert "'other'" in errors[0].msg and "'default'" in errors[0].msg
    with override_settings(DATABASE_ROUTERS=[ROUTER], OUTBOX={"DATABASE": "other"}):
        assert check_outbox_database() == []
    assert check_outbox_database() == []
    result = manage("check", "--database", "default")  # the project's own settings: clean
    assert result.returncode == 0, result.stderr


class NoMigrateOnOther(ToOther):
    def allow_migrate(self, db: str, app_label: str, **hints: Any) -> bool | None:
        return False if db == "other" and app_label == "outbox_toolkit" else None


def test_system_check_warns_when_routers_keep_the_tables_off_the_outbox_database() -> None:
    with override_settings(DATABASE_ROUTERS=[f"{__name__}.NoMigrateOnOther"]):
        assert [e.id for e in check_outbox_database()] == ["outbox.W001"]


def test_bad_settings_are_refused_by_name() -> None:
    with (
        override_settings(OUTBOX={"TABEL": "x"}),
        pytest.raises(ImproperlyConfigured, match="TABEL"),
    ):
        outbox_settings()
    with override_settings(OUTBOX={"TABLE": "bad name"}), pytest.raises(ImproperlyConfigured):
        outbox_settings()
    with (
        override_settings(OUTBOX={"DATABASE": "nope"}),
        pytest.raises(ImproperlyConfigured, match="not in DATABASES"),
    ):
        outbox_settings()
    with override_settings(OUTBOX={"BATCH_SIZE": 0}), pytest.raises(ImproperlyConfigured):
        outbox_settings()
    with (
        override_settings(OUTBOX={"ENCODER": "json.dumps"}),
        pytest.raises(ImproperlyConfigured, match="JSONEncoder"),
    ):
        outbox_settings()
    with override_settings(OUTBOX={"TABEL": "x"}):
        assert [e.id for e in check_outbox_database()] == ["outbox.E001"]


def test_the_url_uses_the_driver_django_uses(vendor: str) -> None:
    url = database_url("default")
    if vendor == "postgresql":
        from django.db.backends.postgresql.psycopg_any import is_psycopg3

        assert url.drivername == ("postgresql+psycopg" if is_psycopg3 else "postgresql+psycopg2")
        assert url.database == connections["default"].settings_dict["NAME"]
    elif vendor == "mysql":
        import MySQLdb

        driver = "pymysql" if MySQLdb.__name__.startswith("pymysql") else "mysqldb"
        assert url.drivername == f"mysql+{driver}"
    else:
        assert url.drivername == "sqlite"


def test_passwords_never_appear_in_command_output(vendor: str) -> None:
    secret = "s3cret-Pw-4711"
    env = {"OBX_DJANGO_PG_PASSWORD": secret, "OBX_DJANGO_MYSQL_PASSWORD": secret}
    for args in (("outbox", "status"), ("outbox", "doctor"), ("outbox", "-vv", "relay", "--once")):
        result = manage(*args, env=env)
        output = result.stdout + result.stderr
        assert secret not in output
        # trust auth: the commands run and show the URL, masked (status shows none)
        if vendor == "postgresql" and args[1] != "status":
            assert "***" in output, output


def test_the_django_version_is_the_one_this_run_is_for() -> None:
    import django

    expected = os.environ.get("OBX_DJANGO_EXPECT_VERSION")
    if expected is None:
        pytest.skip("run by hand: any Django")
    assert django.get_version().startswith(expected + "."), django.get_version()


def test_broker_options_are_read_checked_and_never_shown() -> None:
    with override_settings(OUTBOX={"BROKER_OPTIONS": {"exchange": "orders", "secret": None}}):
        assert outbox_settings().broker_option_items() == ("exchange=orders",)
    with override_settings(
        OUTBOX={"BROKER_OPTIONS": {"concurrency": 4, "verify_tls": False, "headers": {"a": "b"}}}
    ):
        assert outbox_settings().broker_option_items() == (
            "concurrency=4",
            "verify_tls=false",
            'headers={"a": "b"}',
        )
    with (
        override_settings(OUTBOX={"BROKER_OPTIONS": {"secret": b"whsec_hidden-value"}}),
        pytest.raises(ImproperlyConfigured, match=r"\['secret'\]: a string") as refused,
    ):
        outbox_settings()
    assert "hidden-value" not in str(refused.value)
    with (
        override_settings(OUTBOX={"BROKER_OPTIONS": "exchange=orders"}),
        pytest.raises(ImproperlyConfigured, match="must be a dict"),
    ):
        outbox_settings()


def test_columns_is_not_a_setting_of_the_app() -> None:
    """The app's table is laid out by its migrations: COLUMNS is refused as unknown."""
    with (
        override_settings(OUTBOX={"COLUMNS": "event_id=id"}),
        pytest.raises(ImproperlyConfigured, match="unknown key"),
    ):
        outbox_settings()
