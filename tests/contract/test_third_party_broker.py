"""A broker shipped from another package: installed, found by its entry point, contract passed.

``examples/broker_package`` is such a package (docs/architecture.md, "Adding a
broker"). It is installed with pip into a folder of its own (its metadata
carries the ``outbox_core.brokers`` entry point), then, with that folder on
the path: its own tests run the toolkit's contract suite against it, and
``outbox relay --broker jsonl://...`` delivers through it, the scheme found by
the entry point alone.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from outbox_core import Outbox
from outbox_core.testing.broker_contract import CONTRACT

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "examples" / "broker_package"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example package installed by pip into a folder of its own."""
    target = tmp_path_factory.mktemp("site")
    # Built from a copy: the build leaves build/ and *.egg-info beside its sources.
    source = tmp_path_factory.mktemp("src") / "broker_package"
    shutil.copytree(PACKAGE, source, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    install = subprocess.run(
        [
            sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
            "--target", str(target), str(source),
        ],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert install.returncode == 0, install.stdout + install.stderr
    assert list(target.glob("outbox_jsonl_broker-*.dist-info/entry_points.txt"))
    return target


def env_with(site: Path) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]))


def test_its_tests_run_the_whole_contract(site: Path, tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable, "-m", "pytest", str(PACKAGE / "tests"), "-v",
            "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "t"),
            "--rootdir", str(PACKAGE), "-c", os.devnull,
        ],
        capture_output=True, text=True, timeout=300, env=env_with(site), cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    outcome = dict(re.findall(r"::(\w+) (PASSED|SKIPPED|FAILED|ERROR)", result.stdout))
    # Every test of the contract ran and passed, but the one this broker cannot
    # set up (no single message can be made to fail transiently: skipped).
    transient = "test_transient_failure_is_retry_with_retry_after"
    assert {name: outcome.get(name) for name in CONTRACT} == {
        name: "SKIPPED" if name == transient else "PASSED" for name in CONTRACT
    }, result.stdout[-3000:]
    assert outcome["test_the_entry_point_serves_the_scheme"] == "PASSED"


def test_the_relay_finds_it_by_its_entry_point(site: Path, tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'app.db'}"
    outbox = Outbox(db)
    outbox.install()
    with outbox.engine.begin() as conn:
        ids = [outbox.enqueue(conn, "orders.created", {"n": i}, key="k") for i in range(5)]
    outbox.dispose()
    spool = tmp_path / "events.jsonl"
    relay = subprocess.run(
        [
            sys.executable, "-m", "outbox_core.cli", "relay", "--db", db,
            "--broker", f"jsonl://{spool}", "--once",
        ],
        capture_output=True, text=True, timeout=120, env=env_with(site), cwd=tmp_path,
    )  # fmt: skip
    assert relay.returncode == 0, relay.stderr[-3000:]
    assert json.loads(relay.stdout.strip().splitlines()[-1])["sent"] == 5
    lines = [json.loads(line) for line in spool.read_text().splitlines()]
    assert [line["event_id"] for line in lines] == ids
    # Without the package on the path, the scheme is unknown: the error says so.
    missing = subprocess.run(
        [
            sys.executable, "-m", "outbox_core.cli", "relay", "--db", db,
            "--broker", f"jsonl://{spool}", "--once",
        ],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )  # fmt: skip
    assert missing.returncode != 0
    assert "jsonl" in missing.stderr


def test_the_documented_testing_extra_brings_pytest() -> None:
    """`pip install 'outbox-toolkit[testing]'` (docs/architecture.md) names an extra that exists."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert any(dep.startswith("pytest") for dep in extras["testing"])
    assert "'outbox-toolkit[testing]'" in (ROOT / "docs" / "architecture.md").read_text()
    example = tomllib.loads((PACKAGE / "pyproject.toml").read_text())["project"]
    assert example["optional-dependencies"]["test"] == ["outbox-toolkit[testing]"]
    assert example["entry-points"]["outbox_core.brokers"] == {
        "jsonl": "outbox_jsonl:JsonLinesBroker"
    }
