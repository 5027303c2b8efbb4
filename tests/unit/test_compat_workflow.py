"""The compatibility workflow runs what exists, pointed where the tests look.

It runs on GitHub's runners, not here: this checks its broker jobs name test
files that exist and set the variables those tests read.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW = ROOT / ".github" / "workflows" / "compat.yml"


def jobs() -> dict[str, Any]:
    return dict(yaml.safe_load(WORKFLOW.read_text())["jobs"])


def test_broker_jobs_run_existing_suites_against_their_servers() -> None:
    found = jobs()
    tests_text = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("*.py"))
    for name, variable in [
        ("kafka", "OUTBOX_TEST_KAFKA_URL"),
        ("nats", "OUTBOX_TEST_NATS_URL"),
        ("redis", "OUTBOX_TEST_REDIS_URL"),
    ]:
        job = found[name]
        assert variable in job["env"], name
        assert f'"{variable}"' in tests_text, f"no test reads {variable}"
        assert job["env"]["OUTBOX_TEST_BACKENDS"] == "sqlite"
        commands = " ".join(step.get("run", "") for step in job["steps"])
        paths = re.findall(r"tests/[\w/]+\.py", commands)
        assert paths, name
        for path in paths:
            assert (ROOT / path).is_file(), path


def test_every_job_has_a_timeout() -> None:
    for name, job in jobs().items():
        assert job.get("timeout-minutes"), name


def test_mysql_jobs_run_the_optional_driver_tests() -> None:
    """mysqlclient builds from source: the MySQL and MariaDB jobs install it and run its tests."""
    for name in ("mysql", "mariadb"):
        steps = [s for s in jobs()[name]["steps"] if "optional_driver" in s.get("run", "")]
        assert len(steps) == 1, name
        step = steps[0]
        assert "pip install -e '.[mysqlclient]'" in step["run"]
        assert step["env"]["OUTBOX_TEST_OPTIONAL_DRIVERS"] == "1"
        for path in re.findall(r"tests/[\w/]+\.py", step["run"]):
            assert (ROOT / path).is_file(), path
