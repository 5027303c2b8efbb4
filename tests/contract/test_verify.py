"""``outbox verify``: the guarantee kit users run on their own servers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import pytest
import sqlalchemy as sa

from outbox_core import Outbox
from outbox_core.message import Event
from outbox_core.verify import GUARANTEES, verify


def run(*args: str) -> tuple[int, str]:
    """``outbox ARGS`` as a process, the way the README and docs/ci.md show it."""
    done = subprocess.run(
        [sys.executable, "-m", "outbox_core.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ.copy(),
    )
    return done.returncode, done.stdout + done.stderr


def tables(url: str) -> set[str]:
    engine = sa.create_engine(url)
    try:
        return set(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_quick_verify_passes_and_leaves_no_table_behind(
    db_url: str, tmp_path: Path, outbox: Outbox
) -> None:
    """The README's command; the real outbox table is untouched, temporary ones are dropped."""
    with outbox.engine.begin() as conn:
        outbox.enqueue(conn, "mine", {"keep": True})
    before = tables(db_url)
    junit = tmp_path / "verify.xml"
    code, output = run("verify", "--db", db_url, "--quick", "--junit", str(junit))
    assert code == 0, output
    for name, guarantee, _ in GUARANTEES:
        assert name in output and guarantee in output
    assert "0 failed" in output
    assert tables(db_url) == before
    assert outbox.status().counts["pending"] == 1  # the real table was not touched
    suite = ElementTree.parse(junit).getroot()
    assert suite.tag == "testsuite" and suite.get("failures") == "0"
    assert len(suite.findall("testcase")) == len(GUARANTEES)


def test_verify_json_is_one_matrix_row(backend: str, db_url: str) -> None:
    code, output = run("verify", "--db", db_url, "--quick", "--json", "--only", "atomic")
    assert code == 0, output
    row = json.loads(output[output.index("{") :])
    assert row["ok"] is True and row["server"] and row["version"]
    assert [r["name"] for r in row["results"]] == ["atomic"]
    assert row["results"][0]["status"] == "pass"


def test_thorough_runs_more_concurrent_work(db_url: str) -> None:
    code, output = run("verify", "--db", db_url, "--thorough", "--only", "per-key-order", "--json")
    assert code == 0, output
    row = json.loads(output[output.index("{") :])
    assert row["mode"] == "thorough" and row["results"][0]["status"] == "pass"


def test_unknown_guarantee_names_the_known_ones(db_url: str) -> None:
    code, output = run("verify", "--db", db_url, "--only", "speed")
    assert code == 2
    assert "unknown guarantee speed; the guarantees are: atomic, disjoint-claims" in output


def _broken(url: str, table: str, breaks: str) -> Outbox:
    """An outbox whose strategy lacks one safeguard (test-only)."""
    outbox = Outbox(url, table=table)
    dialect = outbox.dialect
    original_claim = dialect.claim

    if breaks == "skip-locked":
        # FOR UPDATE that waits: claims queue behind each other's locks.
        dialect.lock_rows = lambda select: select.with_for_update()  # type: ignore[method-assign]
        dialect._claims.clear()
    else:
        # Ordered claims that ignore keys: no head-of-key check at all.
        def claim(conn: Any, *, limit: int, lease: float, token: str, ordered: bool) -> list[Event]:
            return original_claim(conn, limit=limit, lease=lease, token=token, ordered=False)

        dialect.claim = claim  # type: ignore[method-assign]
    return outbox


@pytest.mark.parametrize(
    ("breaks", "guarantee"), [("skip-locked", "no-waiting"), ("head-of-key", "head-of-key")]
)
def test_a_broken_strategy_fails_the_guarantee_it_breaks(
    backend: str, db_url: str, breaks: str, guarantee: str
) -> None:
    outbox = Outbox(db_url, table="probe")
    if breaks == "skip-locked" and not outbox.dialect.row_locks:
        pytest.skip("SQLite has no row locks to skip")
    outbox.dispose()
    report = verify(
        db_url, mode="quick", only=[guarantee], outbox_factory=lambda u, t: _broken(u, t, breaks)
    )
    assert not report.ok
    [result] = report.results
    assert result.name == guarantee and result.status == "fail", result
    assert result.detail


@pytest.mark.needs_server
def test_verify_broker_option_says_whether_the_broker_answers(db_url: str) -> None:
    from tests.contract.broker_fixtures import require_rabbitmq, unused_port

    up_url = require_rabbitmq()
    code, output = run("verify", "--db", db_url, "--only", "atomic", "--broker", up_url)
    assert code == 0, output
    assert "broker amqp://guest:***@" in output and ": up" in output
    down_url = f"amqp://guest:guest@127.0.0.1:{unused_port()}/%2F"
    code, output = run("verify", "--db", db_url, "--only", "atomic", "--broker", down_url)
    assert code == 1, output
    assert ": DOWN" in output and "guest:guest" not in output
