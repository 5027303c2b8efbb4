"""How the suite shares the machine: which tests run alone, and the timeline of a run.

* ``tests/faults`` runs alone (``ALONE`` in ``tests/conftest.py``), but a test
  there marked ``shared`` runs side by side;
* ``OUTBOX_TEST_TIMELINE`` records, per test, the worker, when it asked for
  its turn, when it began and when it ended.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUTAGE = "test_minute_long_broker_outages_kill_nothing_and_spend_no_attempt"
SIGSTOP = "test_sigstopped_relay_never_stalls_another"


def _pytest(*args: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        capture_output=True, text=True, cwd=ROOT, timeout=240, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_a_test_marked_shared_in_a_module_that_runs_alone_runs_side_by_side() -> None:
    alone = _pytest("--collect-only", "-q", "-n", "0", "-m", "alone", "tests/faults/test_faults.py")
    shared = _pytest(
        "--collect-only", "-q", "-n", "0", "-m", "not alone", "tests/faults/test_faults.py"
    )
    assert SIGSTOP in alone and OUTAGE not in alone
    assert OUTAGE in shared and SIGSTOP not in shared


def test_the_timeline_records_each_test_with_its_worker_and_times(tmp_path: Path) -> None:
    timeline = tmp_path / "timeline.tsv"
    env = {**os.environ, "OUTBOX_TEST_TIMELINE": str(timeline)}
    _pytest("-q", "-n", "2", "tests/unit/test_redaction.py", env=env)
    rows = [line.split("\t") for line in timeline.read_text().splitlines()]
    assert rows and {r[0] for r in rows} <= {"gw0", "gw1"}
    assert all(r[1].startswith("tests/unit/test_redaction.py::") for r in rows)
    assert all(float(r[2]) <= float(r[3]) <= float(r[4]) for r in rows)
