"""CLI commands that need no server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from outbox_core.cli import main


@pytest.mark.parametrize("dialect", ["postgresql", "mysql", "mssql", "sqlite"])
def test_schema_prints_ddl_without_connecting(dialect: str) -> None:
    result = CliRunner().invoke(main, ["schema", "--dialect", dialect, "--table", "events"])
    assert result.exit_code == 0, result.output
    assert "CREATE TABLE events" in result.output
    assert "CREATE TABLE events_inbox" in result.output


def test_schema_refuses_a_bad_table_name() -> None:
    result = CliRunner().invoke(main, ["schema", "--dialect", "sqlite", "--table", "x; drop"])
    assert result.exit_code == 2
    assert "invalid table name" in result.output


def test_demo_holds_every_guarantee() -> None:
    result = CliRunner().invoke(main, ["demo", "--events", "150"])
    assert result.exit_code == 0, result.output
    assert "lost                                 0" in result.output
    assert "per-key order violations             0" in result.output
    assert "killed mid-batch" in result.output
    assert "OK: every guarantee held" in result.output


def test_every_database_command_takes_the_same_database_options() -> None:
    """The options are declared once; doctor takes them like install, status and relay."""
    shared = ["database_url", "table", "schema", "dialect", "config_file"]

    def options(name: str) -> list[tuple[str, tuple[str, ...], str | None]]:
        command = main.commands[name]
        return [(p.name or "", tuple(p.opts), getattr(p, "help", None)) for p in command.params][
            : len(shared)
        ]

    expected = options("install")
    assert [name for name, _, _ in expected] == shared
    for name in ("doctor", "status", "cleanup", "replay", "relay"):
        assert options(name) == expected, name


def test_relay_backoff_flags_reach_the_settings(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``--backoff-base`` and ``--backoff-cap`` (docs: reference/cli.md) set the retry backoff."""
    from outbox_core.outbox import Outbox

    seen: dict[str, Any] = {}

    def relay(self: Outbox, broker_url: str, *, settings: Any, **_: Any) -> None:
        seen["settings"] = settings
        raise click.exceptions.Exit(0)

    monkeypatch.setattr(Outbox, "relay", relay)
    db = f"sqlite:///{tmp_path / 'app.db'}"
    assert CliRunner().invoke(main, ["install", "--db", db]).exit_code == 0
    args = ["relay", "--db", db, "--broker", "memory://b", "--once"]
    args += ["--backoff-base", "2s", "--backoff-cap", "5m"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert (seen["settings"].backoff_base, seen["settings"].backoff_cap) == (2.0, 300.0)
