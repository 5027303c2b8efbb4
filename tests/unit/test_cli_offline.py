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
    shared = ["database_url", "table", "schema", "schemas", "columns", "dialect", "config_file"]

    def options(name: str) -> list[tuple[str, tuple[str, ...], str | None]]:
        command = main.commands[name]
        return [(p.name or "", tuple(p.opts), getattr(p, "help", None)) for p in command.params][
            : len(shared)
        ]

    expected = options("install")
    assert [name for name, _, _ in expected] == shared
    for name in ("doctor", "status", "cleanup", "replay", "relay"):
        assert options(name) == expected, name


def relay_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *flags: str) -> Any:
    """The settings ``outbox relay FLAGS`` hands its relay (which is not run)."""
    from outbox_core.outbox import Outbox

    seen: dict[str, Any] = {}

    def relay(self: Outbox, broker_url: str, *, settings: Any, **_: Any) -> None:
        seen["settings"] = settings
        raise click.exceptions.Exit(0)

    monkeypatch.setattr(Outbox, "relay", relay)
    db = f"sqlite:///{tmp_path / 'app.db'}"
    assert CliRunner().invoke(main, ["install", "--db", db]).exit_code == 0
    args = ["relay", "--db", db, "--broker", "memory://b", "--once", *flags]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    return seen["settings"]


def test_relay_backoff_flags_reach_the_settings(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``--backoff-base`` and ``--backoff-cap`` (docs: reference/cli.md) set the retry backoff."""
    flags = ("--backoff-base", "2s", "--backoff-cap", "5m")
    settings = relay_settings(monkeypatch, tmp_path, *flags)
    assert (settings.backoff_base, settings.backoff_cap) == (2.0, 300.0)


# -- bad input is a usage error, never a traceback --------------------------------------------

BAD_FLAGS = [
    ["status", "--watch", "-1"],
    ["status", "--watch", "nan"],
    ["status", "--watch", "0"],
    ["relay", "--broker", "memory://b", "--metrics-port", "99999"],
    ["relay", "--broker", "memory://b", "--metrics-port", "-1"],
    ["relay", "--broker", "memory://b", "--lease", "30d"],
    ["relay", "--broker", "memory://b", "--lease", "1" * 309],
    ["relay", "--broker", "memory://b", "--lease", "nan"],
    ["relay", "--broker", "memory://b", "--batch-size", "1.5"],
    ["relay", "--broker", "memory://b", "--batch-bytes", "16 parsecs"],
    ["relay", "--broker", "memory://b", "--batch-bytes", "0"],
    ["relay", "--broker", "memory://b", "--poll-interval", "inf"],
    ["cleanup", "--older-than", "inf"],
    ["doctor", "--dead-tuple-ratio", "nan"],
    ["doctor", "--max-backlog-age", "-5m"],
]


@pytest.mark.parametrize("args", BAD_FLAGS, ids=[" ".join(a)[:40] for a in BAD_FLAGS])
def test_a_bad_flag_is_a_usage_error_naming_it(args: list[str], tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'app.db'}"
    result = CliRunner().invoke(main, [args[0], "--db", db, *args[1:]])
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    flag = next(a for a in args if a.startswith("--") and a not in ("--broker",))
    assert f"Invalid value for '{flag}'" in result.output, result.output


BAD_TOML = {
    "lease = nan": "lease",
    "lease = inf": "lease",
    "poll_interval = inf": "poll_interval",
    "batch_size = 1.5": "batch_size",
    "cleanup_after = inf": "cleanup_after",
    'reap_interval = "-5s"': "reap_interval",
    'lease = "30d"': "lease",
}


@pytest.mark.parametrize("line", list(BAD_TOML))
def test_a_bad_toml_value_is_the_toolkits_error_naming_the_setting(
    line: str, tmp_path: Path
) -> None:
    config = tmp_path / "outbox.toml"
    config.write_text(f"[outbox]\n{line}\n", encoding="utf-8")
    db = f"sqlite:///{tmp_path / 'app.db'}"
    result = CliRunner().invoke(
        main, ["relay", "--db", db, "--broker", "memory://b", "--config", str(config), "--once"]
    )
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit), result.exception
    assert result.output.startswith(f"error: {BAD_TOML[line]}"), result.output


def test_a_toml_file_that_is_not_utf8_is_the_toolkits_error(tmp_path: Path) -> None:
    config = tmp_path / "outbox.toml"
    config.write_bytes("[outbox]\ntable = 'caf\u00e9'\n".encode("latin-1"))
    result = CliRunner().invoke(main, ["status", "--db", "sqlite://", "--config", str(config)])
    assert result.exit_code == 2
    assert isinstance(result.exception, SystemExit), result.exception
    assert "is not UTF-8" in result.output


@pytest.mark.parametrize(("given", "expected"), [("16MiB", 16 * 2**20), ("512KiB", 2**19)])
def test_relay_batch_bytes_takes_a_size(
    given: str, expected: int, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``--batch-bytes 16MiB`` (docs: reference/cli.md) bounds a claim's bytes."""
    settings = relay_settings(monkeypatch, tmp_path, "--batch-bytes", given)
    assert settings.batch_bytes == expected
