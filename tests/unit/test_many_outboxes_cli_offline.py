"""Many outboxes on the command line with no server: two SQLite files, and the renderers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from outbox_core import Outbox
from outbox_core.cli import main
from outbox_core.cli.many import Outcome, render_table
from outbox_core.cli.render import status_totals
from outbox_core.dialects.base.presence import PresenceRow
from outbox_core.fleet.targets import Member
from outbox_core.outbox import Status

CLEAN_ENV: dict[str, str | None] = {
    "OUTBOX_DATABASE_URL": None,
    "OUTBOX_DATABASE_URLS": None,
    "OUTBOX_SCHEMAS": None,
    "OUTBOX_SCHEMA": None,
    "OUTBOX_SOURCE": None,
}


def outbox(*args: str) -> Result:
    return CliRunner().invoke(main, list(args), env=CLEAN_ENV)


@pytest.fixture
def files(tmp_path: Path) -> list[str]:
    return [f"sqlite:///{tmp_path / name}.db" for name in ("h1_alpha", "h1_beta")]


def test_two_sqlite_files_installed_and_reported_apart(files: list[str]) -> None:
    both = ["--db", files[0], "--db", files[1]]
    installed = outbox("install", *both)
    assert installed.exit_code == 0, installed.output
    assert "installed in 2 of 2 outboxes" in installed.stdout
    ob = Outbox(files[1])
    with ob.engine.begin() as conn:
        ob.enqueue(conn, "h1.topic", {"n": 1})
    ob.dispose()
    report = json.loads(outbox("status", *both, "--json").stdout)
    assert {k: v["counts"]["pending"] for k, v in report["outboxes"].items()} == {
        "h1_alpha": 0,
        "h1_beta": 1,
    }
    assert report["totals"]["counts"]["pending"] == 1
    replay = outbox("replay", *both, "--id", "1")
    assert replay.exit_code == 2 and "h1_alpha, h1_beta" in replay.stderr


def test_one_outbox_prints_as_before(files: list[str]) -> None:
    assert outbox("install", "--db", files[0]).stdout.startswith("outbox table 'outbox' ready")
    report = json.loads(outbox("status", "--db", files[0], "--json").stdout)
    assert "outboxes" not in report and report["counts"]["pending"] == 0
    assert outbox("replay", "--db", files[0], "--all").stdout == "replayed 0 dead events\n"


def test_sqlite_has_no_schemas_to_match(files: list[str]) -> None:
    result = outbox("status", "--db", files[0], "--schemas", "h1_*")
    assert result.exit_code == 2 and "has no schemas" in result.stderr


def test_the_table_aligns_counts_and_spells_out_a_failed_row(files: list[str]) -> None:
    ok = Member("h1_a", Outbox(files[0]), "sqlite:///a.db")
    down = Member("h1_longer", Outbox(files[1]), "postgresql://u:***@h/db")
    text = render_table(
        ("outbox", "replayed"),
        [Outcome(ok, value=12), Outcome(down, error="connection refused")],
        lambda n: [str(n)],
        ["12"],
    )
    assert text.splitlines() == [
        "outbox     replayed",
        "h1_a             12",
        "h1_longer  ERROR: connection refused (postgresql://u:***@h/db)",
        "total            12",
    ]


def test_status_totals_count_a_relay_serving_many_outboxes_once(files: list[str]) -> None:
    def presence(relay_id: str) -> PresenceRow:
        return PresenceRow(relay_id, "host", 1, "polling", 1.0, 1.0, 0, 0, 0)

    a = Status({"pending": 2, "dead": 1}, 30.0, fleet=[presence("r1")])
    b = Status({"pending": 1, "dead": 0}, 90.0, fleet=[presence("r1"), presence("r2")])
    member = Member("x", Outbox(files[0]), "sqlite:///x.db")
    totals = status_totals(
        [Outcome(member, value=a), Outcome(member, value=b), Outcome(member, error="down")]
    )
    assert totals["counts"] == {"pending": 3, "dead": 1}
    assert totals["oldest_pending_age"] == 90.0
    assert totals["relays"] == 2 and totals["failed"] == 1 and totals["outboxes"] == 3
