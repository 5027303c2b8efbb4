"""Run each suite against each database in a pytest subprocess and collect the results.

One subprocess per (database, suite), from the checkout's root, with
``OUTBOX_TEST_BACKENDS=<backend>`` and that database's
``OUTBOX_TEST_<BACKEND>_URL`` set, and :mod:`compat_matrix.pytest_plugin`
recording every outcome as it happens. The subprocess gets its own process
group so a timeout stops it and everything it started.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compat_matrix.features import BROKERS, CONTRACT, PROPERTY
from compat_matrix.model import (
    EMPTY,
    ERROR,
    FAILED,
    MISSING,
    OK,
    RAN,
    RESULTS_ENV,
    Database,
    SuiteRun,
    TestResult,
    parse_nodeid,
)
from compat_matrix.probe import Target, mask_url, probe, scrub, slug, url_location


@dataclass(frozen=True)
class Suite:
    """A test suite: the paths pytest runs, and paths it leaves out."""

    name: str
    paths: tuple[str, ...]
    ignore: tuple[str, ...]
    description: str


#: The suites, by name.
SUITES: dict[str, Suite] = {
    CONTRACT: Suite(
        CONTRACT,
        ("tests/contract",),
        ("tests/contract/test_brokers.py",),
        "dialect contract, CLI and end to end (tests/contract without test_brokers.py)",
    ),
    BROKERS: Suite(
        BROKERS, ("tests/contract/test_brokers.py",), (), "broker contract (test_brokers.py)"
    ),
    PROPERTY: Suite(PROPERTY, ("tests/property",), (), "property suite (tests/property)"),
}

_EXIT_CODES = {
    2: "pytest was interrupted (exit code 2)",
    3: "pytest internal error (exit code 3)",
    4: "pytest usage error (exit code 4)",
}


@dataclass
class Options:
    """How to run the suites."""

    root: Path
    log_dir: Path
    timeout: float = 1800.0
    pytest_args: list[str] = field(default_factory=list)
    #: extra environment for the subprocesses (e.g. ``OUTBOX_TEST_RABBITMQ_URL``)
    env: dict[str, str] = field(default_factory=dict)
    verbose: bool = False
    #: passwords to scrub from everything recorded
    secrets: list[str] = field(default_factory=list)
    connect_timeout: float = 5.0


def missing_reason(suite: Suite, root: Path) -> str | None:
    """Why ``suite`` cannot run from ``root`` (its files are missing), else ``None``."""
    for rel in suite.paths:
        path = root / rel
        if not path.exists():
            return f"suite missing: {rel} does not exist"
        if path.is_dir() and not any(
            p for pattern in ("test_*.py", "*_test.py") for p in path.rglob(pattern)
        ):
            return f"suite missing: no test files in {rel}"
    return None


@dataclass
class _Parsed:
    collected: list[str] = field(default_factory=list)
    deselected: list[str] = field(default_factory=list)
    tests: dict[str, TestResult] = field(default_factory=dict)
    started: list[str] = field(default_factory=list)
    collect_errors: list[tuple[str, str]] = field(default_factory=list)
    exitstatus: int | None = None
    found: bool = False


def read_results(path: Path) -> _Parsed:
    """Read the plugin's JSON lines; a torn last line (killed process) is ignored."""
    parsed = _Parsed()
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return parsed
    parsed.found = True
    for line in lines:
        try:
            record: dict[str, Any] = json.loads(line)
        except ValueError:
            continue
        event = record.get("event")
        if event == "collected":
            parsed.collected = [str(n) for n in record.get("tests", [])]
        elif event == "deselected":
            parsed.deselected.extend(str(n) for n in record.get("tests", []))
        elif event == "collect_error":
            parsed.collect_errors.append((str(record["nodeid"]), str(record.get("message", ""))))
        elif event == "start":
            parsed.started.append(str(record["nodeid"]))
        elif event == "test":
            result = TestResult.from_dict(record)
            parsed.tests[result.nodeid] = result
        elif event == "finish":
            parsed.exitstatus = int(record["exitstatus"])
    return parsed


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop the subprocess's whole process group: TERM, then KILL after 10 s."""
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def run_suite(
    suite: Suite,
    db: Database,
    target: Target,
    options: Options,
    echo: Callable[[str], None] = lambda _: None,
) -> SuiteRun:
    """Run ``suite`` against ``db`` and return its per-test results."""
    reason = missing_reason(suite, options.root)
    if reason is not None:
        return SuiteRun(suite.name, MISSING, reason)
    options.log_dir.mkdir(parents=True, exist_ok=True)
    results = options.log_dir / f"{db.key}.{suite.name}.jsonl"
    log = options.log_dir / f"{db.key}.{suite.name}.log"
    results.unlink(missing_ok=True)

    args = [
        *suite.paths,
        *(f"--ignore={p}" for p in suite.ignore),
        "-p",
        "compat_matrix.pytest_plugin",
        "-p",
        "no:cacheprovider",
        "--color=no",
        *options.pytest_args,
    ]
    env = os.environ.copy()
    env.update(options.env)
    shown_env = {"OUTBOX_TEST_BACKENDS": db.backend}
    env["OUTBOX_TEST_BACKENDS"] = db.backend
    if target.url:
        url_var = f"OUTBOX_TEST_{db.backend.upper()}_URL"
        env[url_var] = target.url
        shown_env[url_var] = mask_url(target.url)
    env[RESULTS_ENV] = str(results)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(options.root), env.get("PYTHONPATH", "")) if p
    )
    command = " ".join(f"{k}={shlex.quote(v)}" for k, v in shown_env.items())
    command += " python -m pytest " + shlex.join(args)

    started = time.monotonic()
    timed_out = False
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pytest", *args],
            cwd=options.root,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=None if options.verbose else out,
            stderr=None if options.verbose else subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code = proc.wait(timeout=options.timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _stop(proc)
            code = proc.returncode
        except BaseException:
            _stop(proc)
            raise
    duration = time.monotonic() - started
    parsed = read_results(results)
    run = _interpret(suite, parsed, code, timed_out, options)
    run.duration = round(duration, 3)
    run.command = command
    for test in run.tests:
        test.message = scrub(test.message, options.secrets)
    run.reason = scrub(run.reason, options.secrets)
    if run.status == ERROR and not options.verbose:
        tail = scrub(_tail(log), options.secrets)
        echo(f"  {run.reason}; last lines of the pytest output:\n{tail}")
    return run


def _interpret(
    suite: Suite, parsed: _Parsed, code: int | None, timed_out: bool, options: Options
) -> SuiteRun:
    tests = list(parsed.tests.values())
    run = SuiteRun(
        suite.name,
        RAN,
        exit_code=code,
        collected=parsed.collected,
        deselected=parsed.deselected,
        tests=tests,
    )
    for nodeid, message in parsed.collect_errors:
        function = "<collection error>"
        tests.append(
            TestResult(
                nodeid=f"{nodeid}::{function}",
                function=function,
                qualname=function,
                params="",
                outcome=FAILED,
                message=message,
            )
        )
    if timed_out:
        hung = [n for n in parsed.started if n not in parsed.tests]
        for nodeid in hung[-1:]:
            function, qualname, params = parse_nodeid(nodeid)
            tests.append(
                TestResult(
                    nodeid=nodeid,
                    function=function,
                    qualname=qualname,
                    params=params,
                    outcome=FAILED,
                    message=f"still running when the run was stopped after {options.timeout:g}s",
                    uses_backend=True,
                )
            )
        run.status = ERROR
        run.reason = f"timed out after {options.timeout:g}s"
        if hung:
            run.reason += f" (in {hung[-1].rpartition('::')[2]})"
        return run
    if code == 5:
        run.status, run.reason = EMPTY, "no tests collected"
        if options.pytest_args:
            run.reason += f" (pytest args: {shlex.join(options.pytest_args)})"
        return run
    if not parsed.found:
        run.status = ERROR
        run.reason = f"pytest exited {code} and recorded nothing (plugin not loaded?)"
        return run
    if parsed.collect_errors:
        run.status = ERROR
        files = ", ".join(n for n, _ in parsed.collect_errors[:3])
        run.reason = f"collection error in {files}"
        return run
    if code is None or code < 0:
        run.status = ERROR
        run.reason = f"pytest was killed (signal {-(code or 0)})"
        return run
    if code in _EXIT_CODES:
        run.status, run.reason = ERROR, _EXIT_CODES[code]
        return run
    if code == 1 and not any(t.outcome == FAILED for t in tests):
        run.status = ERROR
        run.reason = "pytest exited 1 without reporting a failed test"
        return run
    if code not in (0, 1):
        run.status, run.reason = ERROR, f"pytest exited {code}"
    return run


def _unique_column(db: Database, target: Target, used: set[str]) -> None:
    if db.column in used and target.url:
        db.column = f"{db.column} @ {url_location(target.url)}"
    base, n = db.column, 2
    while db.column in used:
        db.column = f"{base} #{n}"
        n += 1
    used.add(db.column)
    db.key = slug(db.column)


def run_matrix(
    targets: Sequence[Target],
    suites: Sequence[str],
    options: Options,
    echo: Callable[[str], None] = lambda _: None,
) -> list[Database]:
    """Probe every target, then run every suite on every reachable, supported one."""
    databases: list[Database] = []
    used: set[str] = set()
    for target in targets:
        db = probe(target, timeout=options.connect_timeout)
        _unique_column(db, target, used)
        databases.append(db)
        if db.status != OK:
            echo(f"[{db.column}] not run: {db.status}: {db.reason}")
            continue
        echo(f"[{db.column}] {db.version_string}")
        for name in suites:
            suite = SUITES[name]
            echo(f"[{db.column}] {name}: running {' '.join(suite.paths)} ...")
            run = run_suite(suite, db, target, options, echo)
            db.runs[name] = run
            counts = run.counts()
            summary = ", ".join(f"{n} {k}" for k, n in counts.items() if n)
            status = run.status if run.status == RAN else f"{run.status}: {run.reason}"
            echo(
                f"[{db.column}] {name}: {status}"
                + (f" ({summary}) in {run.duration:.1f}s" if summary else "")
            )
    return databases
