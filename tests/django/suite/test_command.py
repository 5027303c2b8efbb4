"""``manage.py outbox``: the CLI on Django's databases, from the shell and from call_command."""

from __future__ import annotations

import io
import json

import pytest
from django.core.management import CommandError, call_command
from django.db import transaction
from django.test import override_settings

from outbox_core.contrib.django import outbox
from outbox_core.contrib.django.management.commands.outbox import cli_environment
from tests.django.suite.conftest import manage

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


def test_help_is_the_clis() -> None:
    result = manage("outbox", "--help")
    assert result.returncode == 0
    assert "Usage: manage.py outbox" in result.stdout
    for command in ("relay", "status", "replay", "cleanup", "doctor", "verify"):
        assert command in result.stdout
    relay = manage("outbox", "relay", "--help")
    assert "--ordered" in relay.stdout and "--broker-option" in relay.stdout


def test_settings_give_the_knobs_an_environment_variable_or_flag_overrides(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with override_settings(OUTBOX={"BATCH_SIZE": 7, "ORDERED": True, "TABLE": "outbox"}):
        env = cli_environment(None)
        assert env["OUTBOX_BATCH_SIZE"] == "7"
        assert env["OUTBOX_ORDERING"] == "partitions"  # ORDERED: the shorthand
        assert env["OUTBOX_TABLE"] == "outbox"
        monkeypatch.setenv("OUTBOX_BATCH_SIZE", "50")
        assert "OUTBOX_BATCH_SIZE" not in cli_environment(None)  # the variable wins
