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
from outbox_core.errors import UnsupportedDatabase
from outbox_core.message import Event
from outbox_core.verify import GUARANTEES, verify
from tests.support import outbox_cli


def run(*args: str) -> tuple[int, str]:
    """``outbox ARGS``: its exit code, and its output and errors together."""
    done = outbox_cli(*args)
    return done.returncode, done.stdout + done.stderr


def tables(url: str) -> set[str]:
    engine = sa.create_engine(url)
    try:
        return set(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()


#: Everything but the two long runs, which the packaging test runs from the wheel
#: (``--quick``, every guarantee) and tests/property and tests/chaos run at length.
SHORT = [name for name, _, _ in GUARANTEES if name not in ("state-machine", "sigkill")]


def test_quick_verify_passes_and_leaves_no_table_behind(
    db_url: str, tmp_path: Path, outbox: Outbox
) -> None:
    """The README's command; the real outbox table is untouched, temporary ones are dropped."""
    with outbox.engine.begin() as conn:
        outbox.enqueue(conn, "mine", {"keep": True})
    before = tables(db_url)
    junit = tmp_path / "verify.xml"
    only = [arg for name in SHORT for arg in ("--only", name)]
    code, output = run("verify", "--db", db_url, "--quick", "--junit", str(junit), *only)
    assert code == 0, output
    for name, guarantee, _ in GUARANTEES:
        if name in SHORT:
            assert name in output and guarantee in output
    assert "0 failed" in output
    # Only verify's own tables are compared: other runs on the same server may
    # create and drop tables of their own meanwhile.
    left = {t for t in tables(db_url) - before if t.startswith("outbox_verify_")}
    assert not left, left
    assert outbox.table.name in tables(db_url)
    assert outbox.status().counts["pending"] == 1  # the real table was not touched
    suite = ElementTree.parse(junit).getroot()
    assert suite.tag == "testsuite" and suite.get("failures") == "0"
    assert len(suite.findall("testcase")) == len(SHORT)


def test_outbox_matrix_merges_rows_into_one_markdown_table(tmp_path: Path) -> None:
    """``outbox matrix`` (docs/ci.md's summary step): servers across, guarantees down."""
    ok = {
        "url": "postgresql+psycopg://app:***@db/app",
        "server": "PostgreSQL",
        "version": "17.2",
        "mode": "default",
        "seconds": 41.0,
        "ok": True,
        "results": [
            {"name": "atomic", "guarantee": "commits with it", "status": "pass",
             "seconds": 0.1, "detail": ""},
            {"name": "no-waiting", "guarantee": "skips locks", "status": "pass",
             "seconds": 0.1, "detail": ""},
        ],
    }  # fmt: skip
    broken = {
        **ok,
        "server": "MySQL",
        "version": "5.7.44",
        "ok": False,
        "results": [
            ok["results"][0],  # type: ignore[index]
            {"name": "no-waiting", "guarantee": "skips locks", "status": "fail",
             "seconds": 2.0, "detail": "a claim waited 2.0s | for rows"},
        ],
    }  # fmt: skip
    (tmp_path / "a.json").write_text(json.dumps(ok))
    (tmp_path / "b.json").write_text(json.dumps(broken))
    code, output = run("matrix", str(tmp_path / "a.json"), str(tmp_path / "b.json"))
    assert code == 1, output
    assert "| guarantee | PostgreSQL 17.2 | MySQL 5.7.44 |" in output
    assert "| `no-waiting`: skips locks | pass | **FAIL** [1] |" in output
    assert "1. MySQL 5.7.44, `no-waiting`: a claim waited 2.0s \\| for rows" in output
    code, output = run("matrix", str(tmp_path / "a.json"))
    assert code == 0 and "PostgreSQL 17.2: ok" in output


@pytest.mark.needs_server
def test_compat_matrix_is_rendered_from_verify_rows(
    db_url: str, backend: str, tmp_path: Path
) -> None:
    """``python -m compat_matrix`` runs ``outbox verify`` per server and writes MATRIX.md."""
    if backend == "sqlite":
        pytest.skip("compat_matrix adds its own SQLite column to every run")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_TEST_")}
    done = subprocess.run(
        [sys.executable, "-m", "compat_matrix", f"--{backend}", db_url, "--quick",
         "--only", "atomic", "--only", "fencing", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    markdown = (tmp_path / "MATRIX.md").read_text()
    [run_] = json.loads((tmp_path / "matrix.json").read_text())
    columns = [f"{r['server']} {r['version']}" for r in run_["rows"]]
    assert columns[0].startswith("SQLite ") and len(columns) == 2
    assert f"| guarantee | {columns[0]} | {columns[1]} |" in markdown
    assert "| `fencing`: an expired, re-claimed lease cannot settle | pass | pass |" in markdown
    assert f"- command: `python -m compat_matrix --{backend} " in markdown
    merged = tmp_path / "merged"
    again = subprocess.run(
        [sys.executable, "-m", "compat_matrix", "merge", str(tmp_path / "matrix.json"),
         str(tmp_path / "matrix.json"), "--out", str(merged)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert "## Run 2" in (merged / "MATRIX.md").read_text()


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
    elif breaks == "idle-limit":
        # Relay connections without server-side limits: a frozen claim holds on forever.
        dialect.session.configure = lambda conn, limits: None  # type: ignore[method-assign]
    else:
        # Ordered claims that ignore keys: no head-of-key check at all.
        def claim(conn: Any, *, limit: int, lease: float, token: str, ordered: bool) -> list[Event]:
            return original_claim(conn, limit=limit, lease=lease, token=token, ordered=False)

        dialect.claim = claim  # type: ignore[method-assign]
    return outbox


@pytest.mark.parametrize(
    ("breaks", "guarantee"),
    [
        ("skip-locked", "no-waiting"),
        ("head-of-key", "head-of-key"),
        ("idle-limit", "frozen-claim"),
    ],
)
def test_a_broken_strategy_fails_the_guarantee_it_breaks(
    backend: str, db_url: str, breaks: str, guarantee: str
) -> None:
    outbox = Outbox(db_url, table="probe")
    if breaks == "skip-locked" and not outbox.dialect.row_locks:
        pytest.skip("SQLite has no row locks to skip")
    if breaks == "idle-limit" and outbox.dialect.frozen_transactions_stay:
        pytest.skip(outbox.dialect.frozen_transactions_stay)
    outbox.dispose()
    report = verify(
        db_url, mode="quick", only=[guarantee], outbox_factory=lambda u, t: _broken(u, t, breaks)
    )
    assert not report.ok
    [result] = report.results
    assert result.name == guarantee and result.status == "fail", result
    assert result.detail


def test_ordered_guarantees_skip_with_the_reason_ordered_relays_refuse(
    db_url: str, backend: str
) -> None:
    """Where the dialect refuses ordered relays (SQL Server without RCSI), say so, don't hang."""
    reason = "ordered relays need READ_COMMITTED_SNAPSHOT ON: run ALTER DATABASE ..."

    def refusing(url: str, table: str) -> Outbox:
        outbox = Outbox(url, table=table)

        def check_ordered(conn: Any) -> None:
            raise UnsupportedDatabase(reason)

        outbox.dialect.check_ordered = check_ordered  # type: ignore[method-assign]
        return outbox

    ordered = ["head-of-key", "per-key-order", "ordered-runs", "state-machine"]
    only = [*ordered, "atomic"] + (["sigkill"] if backend == "sqlite" else [])
    report = verify(db_url, mode="quick", only=only, outbox_factory=refusing)
    assert report.ok
    statuses = {r.name: (r.status, r.detail) for r in report.results}
    assert statuses.pop("atomic")[0] == "pass"
    if backend == "sqlite":  # one database is enough for this 10 s run
        # The SIGKILL run still checks loss, with unordered relays, and says so.
        status, detail = statuses.pop("sigkill")
        assert status == "pass" and f"relays unordered, key order not checked: {reason}" in detail
    assert statuses == dict.fromkeys(ordered, ("skip", reason))


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


def test_without_hypothesis_the_state_machine_is_skipped_and_says_why(
    backend: str, db_url: str, tmp_path: Path
) -> None:
    """Installed without the ``verify`` extra: that one row skips, naming the extra."""
    if backend != "sqlite":
        pytest.skip("the same on every database: SQLite is enough")
    shadow = tmp_path / "shadow" / "hypothesis"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('No module named hypothesis')\n")
    env = {**os.environ, "PYTHONPATH": str(shadow.parent)}
    done = subprocess.run(
        [sys.executable, "-m", "outbox_core.cli", "verify", "--db", db_url, "--quick",
         "--only", "state-machine", "--only", "atomic"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SKIP  state-machine" in done.stdout
    assert "needs hypothesis: pip install 'outbox-toolkit[verify]'" in done.stdout
    assert "PASS  atomic" in done.stdout
