"""A pytest plugin that records each test's outcome as one JSON line, as it happens.

The runner loads it with ``-p compat_matrix.pytest_plugin`` and names the
output file in ``COMPAT_MATRIX_RESULTS``; without that variable the plugin
does nothing. Lines are written and flushed as tests finish, so a run killed
at its timeout still leaves every finished test behind, plus the test that
was running (its ``start`` line without a ``test`` line).

Events, one JSON object per line:

* ``{"event": "collected", "tests": [nodeid, ...]}`` after collection and deselection
* ``{"event": "deselected", "tests": [nodeid, ...]}`` tests left out by ``-k`` / ``-m``
* ``{"event": "collect_error", "nodeid": ..., "message": ...}``
* ``{"event": "start", "nodeid": ...}``
* ``{"event": "test", "nodeid", "function", "qualname", "params", "outcome",
  "message", "duration", "uses_backend"}``: outcome is passed, failed or skipped
  (an xfail counts as skipped, an xpass as passed)
* ``{"event": "finish", "exitstatus": n}``
"""

from __future__ import annotations

import json
import os
from typing import IO, Any

import pytest

from compat_matrix.model import RESULTS_ENV, parse_nodeid

_MESSAGE_LIMIT = 2000


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        reason = str(longrepr[2])
    else:
        reason = str(longrepr or "")
    return reason.removeprefix("Skipped: ").strip()


def _failure_message(report: pytest.TestReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        message = str(getattr(crash, "message", ""))
        path, lineno = getattr(crash, "path", ""), getattr(crash, "lineno", "")
        text = f"{message} ({os.path.basename(str(path))}:{lineno})" if path else message
    else:
        text = report.longreprtext.strip()
        text = text[-_MESSAGE_LIMIT:]
    if report.when != "call":
        text = f"error in {report.when}: {text}"
    return text[:_MESSAGE_LIMIT]


class Recorder:
    """Writes the events described in the module docstring to one file."""

    def __init__(self, path: str) -> None:
        self.out: IO[str] = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed at the end
        self.meta: dict[str, dict[str, Any]] = {}
        self.state: dict[str, dict[str, Any]] = {}

    def write(self, record: dict[str, Any]) -> None:
        """Append one event and flush it to disk."""
        if self.out.closed:
            return
        self.out.write(json.dumps(record, default=str) + "\n")
        self.out.flush()

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        """Remember each selected test's name, parameters and fixtures."""
        for item in session.items:
            function = str(getattr(item, "originalname", None) or item.name.partition("[")[0])
            cls = getattr(item, "cls", None)
            callspec = getattr(item, "callspec", None)
            self.meta[item.nodeid] = {
                "function": function,
                "qualname": f"{cls.__name__}::{function}" if cls is not None else function,
                "params": str(callspec.id) if callspec is not None else "",
                "uses_backend": "backend" in getattr(item, "fixturenames", ()),
            }
        self.write({"event": "collected", "tests": [item.nodeid for item in session.items]})

    def pytest_deselected(self, items: list[pytest.Item]) -> None:
        """Record tests left out by ``-k``, ``-m`` or another plugin."""
        self.write({"event": "deselected", "tests": [item.nodeid for item in items]})

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        """Record collection errors: they hide every test of the file."""
        if report.failed:
            text = report.longreprtext.strip()
            errors = [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]
            if errors:  # the exception last-first: "SyntaxError: invalid syntax", then context
                text = "\n".join([errors[-1], *errors[:-1][-8:]])
            self.write(
                {
                    "event": "collect_error",
                    "nodeid": report.nodeid,
                    "message": text[-_MESSAGE_LIMIT:],
                }
            )

    def pytest_runtest_logstart(self, nodeid: str, location: tuple[str, int | None, str]) -> None:
        """Note the test that is about to run (it may hang)."""
        self.write({"event": "start", "nodeid": nodeid})

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """Fold setup, call and teardown into one outcome; write it after teardown."""
        state = self.state.setdefault(
            report.nodeid, {"outcome": "passed", "message": "", "duration": 0.0}
        )
        state["duration"] += report.duration
        wasxfail = getattr(report, "wasxfail", None)
        if report.failed:
            if state["outcome"] != "failed":
                state["outcome"] = "failed"
                state["message"] = _failure_message(report)
        elif report.skipped and state["outcome"] == "passed":
            state["outcome"] = "skipped"
            if wasxfail is not None:
                state["message"] = f"xfail: {wasxfail}".rstrip(": ")
            else:
                state["message"] = _skip_reason(report)
        if report.when != "teardown":
            return
        self.state.pop(report.nodeid, None)
        meta = self.meta.get(report.nodeid) or _meta_from_nodeid(report.nodeid)
        self.write(
            {
                "event": "test",
                "nodeid": report.nodeid,
                **meta,
                "outcome": state["outcome"],
                "message": state["message"],
                "duration": round(float(state["duration"]), 3),
            }
        )

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        """Record pytest's exit status and close the file."""
        self.write({"event": "finish", "exitstatus": int(exitstatus)})
        self.out.close()


def _meta_from_nodeid(nodeid: str) -> dict[str, Any]:
    function, qualname, params = parse_nodeid(nodeid)
    return {"function": function, "qualname": qualname, "params": params, "uses_backend": False}


def pytest_configure(config: pytest.Config) -> None:
    """Start recording when ``COMPAT_MATRIX_RESULTS`` names a file."""
    path = os.environ.get(RESULTS_ENV)
    if path and not config.pluginmanager.has_plugin("compat_matrix_recorder"):
        config.pluginmanager.register(Recorder(path), "compat_matrix_recorder")
