"""``manage.py outbox``: the CLI on Django's databases, from the shell and from call_command."""

from __future__ import annotations

import io
import json

import pytest
from django.core.management import CommandError, call_command
from django.db import transaction
from django.test import override_settings

from outbox_core.contrib.django import outbox
from outbox_core.contrib.django.cli import knob_environment
from outbox_core.contrib.django.conf import outbox_settings
from tests.django.suite.conftest import manage

#: A broker nobody answers at (port 1), with a password that must never show.
DEAD_BROKER = "amqp://guest:dead-broker-pw@127.0.0.1:1/%2F"

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")


def test_call_command_runs_the_cli_and_keeps_its_exit_code() -> None:
    with transaction.atomic():
        outbox.enqueue("t", {"n": 1})
    out = io.StringIO()
    call_command("outbox", "status", "--json", stdout=out)
    assert json.loads(out.getvalue())["counts"]["pending"] == 1
    with pytest.raises(CommandError) as failed:
        call_command("outbox", "replay", stdout=io.StringIO(), stderr=io.StringIO())
    assert failed.value.returncode == 2  # the CLI's usage error: replay needs a selector


def test_database_picks_another_alias() -> None:
    with transaction.atomic(using="other"):
        outbox.enqueue("t.other", {"n": 1}, using="other")
    other = manage("outbox", "--database", "other", "status", "--json")
    assert other.returncode == 0, other.stderr
    assert json.loads(other.stdout)["counts"]["pending"] == 1
    default = manage("outbox", "status", "--json")
    assert json.loads(default.stdout)["counts"]["pending"] == 0
    unknown = manage("outbox", "--database", "nope", "status")
    assert unknown.returncode == 2
    assert "'nope' is not in DATABASES" in unknown.stderr


def test_help_is_djangos_view() -> None:
    """Only what means something under Django: no --db/--table/..., no install."""
    result = manage("outbox", "--help")
    assert result.returncode == 0, result.stderr
    assert "Usage: manage.py outbox" in result.stdout
    listed = result.stdout.split("Commands:")[1].split()
    commands = {w for w in listed if w.isalpha() and w.islower() and len(w) > 3}
    assert {"relay", "status", "replay", "cleanup", "doctor", "verify"} <= commands
    for gone in ("install", "uninstall", "schema", "dashboard", "migrate", "demo", "matrix"):
        assert f"  {gone} " not in result.stdout
    assert "--database ALIAS" in result.stdout
    for command in ("relay", "status", "replay", "cleanup", "doctor", "verify"):
        text = manage("outbox", command, "--help").stdout
        assert "--database ALIAS" in text, command
        for flag in ("--db ", "--table", "--schema", "--config", "--dialect", "--columns"):
            assert flag not in text, (command, flag)
    relay = manage("outbox", "relay", "--help").stdout
    assert "--ordered" in relay and "--broker-option" in relay
    assert "settings.OUTBOX" in relay  # where the broker comes from
    django_help = manage("help", "outbox")
    assert "Usage: manage.py outbox" in django_help.stdout, django_help.stderr


def test_what_django_answers_is_refused_with_the_reason() -> None:
    db = manage("outbox", "status", "--db", "sqlite:///x.db")
    assert db.returncode == 2
    assert "--db is not taken here" in db.stderr and "DATABASES" in db.stderr
    table = manage("outbox", "replay", "--table", "other", "--all")
    assert table.returncode == 2 and "settings.OUTBOX['TABLE']" in table.stderr
    install = manage("outbox", "install")
    assert install.returncode == 2
    assert "manage.py migrate" in install.stderr, install.stderr


def test_database_is_taken_after_the_command_too() -> None:
    with transaction.atomic(using="other"):
        outbox.enqueue("t.other", {"n": 1}, using="other")
    after = manage("outbox", "status", "--json", "--database", "other")
    assert after.returncode == 0, after.stderr
    assert json.loads(after.stdout)["counts"]["pending"] == 1
    out = io.StringIO()
    call_command("outbox", "status", "--database", "other", "--json", stdout=out)
    assert json.loads(out.getvalue())["counts"]["pending"] == 1
    out = io.StringIO()
    call_command("outbox", "status", "--json", database="other", stdout=out)
    assert json.loads(out.getvalue())["counts"]["pending"] == 1


def test_a_missing_broker_names_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OUTBOX_BROKER_URL", raising=False)
    err = io.StringIO()
    with (
        override_settings(OUTBOX={"POLL_INTERVAL": "100ms"}),
        pytest.raises(CommandError) as failed,
    ):
        call_command("outbox", "relay", "--once", stdout=io.StringIO(), stderr=err)
    assert failed.value.returncode == 2
    assert 'set settings.OUTBOX["BROKER_URL"]' in err.getvalue()
    assert "OUTBOX_BROKER_URL" not in err.getvalue()
    assert "outbox.toml" not in err.getvalue()


def test_status_probes_the_broker_only_when_asked() -> None:
    """As its help says: exit 1 for a broker that is down only with --broker."""
    env = {"OUTBOX_BROKER_URL": DEAD_BROKER}
    plain = manage("outbox", "status", "--json", env=env)
    assert plain.returncode == 0, plain.stdout + plain.stderr
    assert json.loads(plain.stdout)["broker"] is None
    asked = manage("outbox", "status", "--json", "--broker", env=env)
    assert asked.returncode == 1, asked.stdout + asked.stderr
    broker = json.loads(asked.stdout)["broker"]
    assert broker["up"] is False
    assert "dead-broker-pw" not in asked.stdout + asked.stderr


def test_missing_tables_say_manage_py_migrate(fresh_database: str) -> None:
    """A database Django's migrations have not run on: the fix is `manage.py migrate`."""
    env = {"OBX_DJANGO_DB_NAME": fresh_database}
    for args in (("outbox", "relay", "--once"), ("outbox", "doctor")):
        result = manage(*args, env=env)
        output = result.stdout + result.stderr
        assert result.returncode != 0, (args, output)
        assert "manage.py migrate" in output, (args, output)
        assert "outbox install" not in output, (args, output)


def test_settings_give_the_knobs_an_environment_variable_or_flag_overrides(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with override_settings(OUTBOX={"BATCH_SIZE": 7, "ORDERED": True, "TABLE": "outbox"}):
        env = knob_environment(outbox_settings())
        assert env["OUTBOX_BATCH_SIZE"] == "7"
        assert env["OUTBOX_ORDERING"] == "partitions"  # ORDERED: the shorthand
        assert env["OUTBOX_SCHEMA"] == ""  # Django's connection decides it
        monkeypatch.setenv("OUTBOX_BATCH_SIZE", "50")
        assert "OUTBOX_BATCH_SIZE" not in knob_environment(outbox_settings())  # the variable wins


@pytest.mark.parametrize(
    ("core", "django"),
    [
        (
            "fix: outbox install --db 'postgresql://u:***@h/db' --table outbox  (creates)",
            "fix: python manage.py migrate outbox_toolkit  (creates)",
        ),
        (
            "run `outbox install --db sqlite:////tmp/x.db --table outbox` first",
            "run `python manage.py migrate outbox_toolkit` first",
        ),
        ("(outbox install sets it too)", "(python manage.py migrate outbox_toolkit sets it too)"),
        ("`outbox install --source wal` creates it", "`outbox install --source wal` creates it"),
    ],
)
def test_the_generic_install_hint_becomes_migrate(core: str, django: str) -> None:
    from outbox_core.contrib.django.hints import django_wording

    assert django_wording(core) == django
