"""The matrix's data: databases, suite runs, per-test results, and their JSON form.

``matrix.json`` holds the raw per-test results, not only the cells, so that
:mod:`compat_matrix.cells` can recompute the cells from it (``merge`` does).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

#: Version of the ``matrix.json`` layout.
SCHEMA = 1
#: Environment variable naming the file :mod:`compat_matrix.pytest_plugin` writes to.
RESULTS_ENV = "COMPAT_MATRIX_RESULTS"

# Outcomes of one test.
PASSED = "passed"
FAILED = "failed"
SKIPPED = "skipped"

# Status of one suite run on one database.
RAN = "ran"  # pytest ran and reported (exit code 0 or 1)
MISSING = "missing"  # the suite's files do not exist
EMPTY = "empty"  # pytest collected nothing (exit code 5)
ERROR = "error"  # timeout, crash, collection or usage error: unreported tests fail
NOT_RUN = "not run"  # the database was unreachable or unsupported

# Status of one database.
OK = "ok"
UNREACHABLE = "unreachable"
UNSUPPORTED = "unsupported"


def parse_nodeid(nodeid: str) -> tuple[str, str, str]:
    """``(function, qualname, params)`` of a pytest node id.

    ``tests/a.py::TestX::test_y[sqlite-ordered]`` gives ``test_y``,
    ``TestX::test_y`` and ``sqlite-ordered``.
    """
    base, bracket, rest = nodeid.partition("[")
    params = rest[:-1] if bracket and rest.endswith("]") else rest
    parts = base.split("::")
    qualname = "::".join(parts[1:]) if len(parts) > 1 else parts[0]
    return parts[-1], qualname, params


@dataclass
class TestResult:
    """The outcome of one test (one parametrisation) on one database."""

    __test__ = False  # not a pytest test class

    nodeid: str
    function: str
    qualname: str
    params: str
    outcome: str
    message: str = ""
    duration: float = 0.0
    #: the test used the ``backend`` fixture (it talks to the database under test)
    uses_backend: bool = False

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TestResult:
        """Read one test from ``matrix.json`` or from the plugin's output."""
        return cls(
            nodeid=str(data["nodeid"]),
            function=str(data.get("function", "")),
            qualname=str(data.get("qualname", data.get("function", ""))),
            params=str(data.get("params", "")),
            outcome=str(data["outcome"]),
            message=str(data.get("message", "")),
            duration=float(data.get("duration", 0.0)),
            uses_backend=bool(data.get("uses_backend", False)),
        )


@dataclass
class SuiteRun:
    """One pytest run: one suite on one database."""

    suite: str
    status: str
    reason: str = ""
    exit_code: int | None = None
    duration: float = 0.0
    command: str = ""
    #: node ids pytest collected (after ``-k`` / deselection), in order
    collected: list[str] = field(default_factory=list)
    #: node ids left out by ``-k`` / ``-m`` (not a sign of a stale mapping)
    deselected: list[str] = field(default_factory=list)
    tests: list[TestResult] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        """Tests per outcome."""
        counts = {PASSED: 0, FAILED: 0, SKIPPED: 0}
        for test in self.tests:
            counts[test.outcome] = counts.get(test.outcome, 0) + 1
        return counts

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SuiteRun:
        """Read one run from ``matrix.json``."""
        exit_code = data.get("exit_code")
        return cls(
            suite=str(data["suite"]),
            status=str(data["status"]),
            reason=str(data.get("reason", "")),
            exit_code=None if exit_code is None else int(exit_code),
            duration=float(data.get("duration", 0.0)),
            command=str(data.get("command", "")),
            collected=[str(n) for n in data.get("collected", [])],
            deselected=[str(n) for n in data.get("deselected", [])],
            tests=[TestResult.from_dict(t) for t in data.get("tests", [])],
        )


@dataclass
class Database:
    """One column: a database server (or SQLite) and the suites run against it."""

    key: str
    column: str
    backend: str
    url: str
    product: str = ""
    version: str = ""
    version_string: str = ""
    driver: str = ""
    status: str = OK
    reason: str = ""
    runs: dict[str, SuiteRun] = field(default_factory=dict)
    #: index into :attr:`Matrix.sources` of the invocation that produced it
    source: int = 0

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Database:
        """Read one database from ``matrix.json``."""
        runs = data.get("runs", {})
        return cls(
            key=str(data["key"]),
            column=str(data["column"]),
            backend=str(data["backend"]),
            url=str(data.get("url", "")),
            product=str(data.get("product", "")),
            version=str(data.get("version", "")),
            version_string=str(data.get("version_string", "")),
            driver=str(data.get("driver", "")),
            status=str(data.get("status", OK)),
            reason=str(data.get("reason", "")),
            runs={str(k): SuiteRun.from_dict(v) for k, v in runs.items()},
            source=int(data.get("source", 0)),
        )


@dataclass
class Source:
    """One invocation of ``python -m compat_matrix``: when, where, how."""

    generated_at: str
    commit: str
    command: str
    environment: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Source:
        """Read one invocation from ``matrix.json``."""
        return cls(
            generated_at=str(data.get("generated_at", "")),
            commit=str(data.get("commit", "")),
            command=str(data.get("command", "")),
            environment={str(k): str(v) for k, v in data.get("environment", {}).items()},
        )


@dataclass
class Cell:
    """The verdict of one feature on one database."""

    status: str
    reason: str = ""
    #: node id -> outcome of every test the cell looked at
    tests: dict[str, str] = field(default_factory=dict)
    #: the failures: node id -> message
    failures: dict[str, str] = field(default_factory=dict)


@dataclass
class Matrix:
    """Everything ``matrix.json`` holds except the computed cells."""

    generated_at: str
    suites: list[str]
    sources: list[Source] = field(default_factory=list)
    databases: list[Database] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The raw part of ``matrix.json`` (cells are added by the caller)."""
        return {
            "schema": SCHEMA,
            "generated_at": self.generated_at,
            "suites": list(self.suites),
            "sources": [asdict(s) for s in self.sources],
            "databases": [asdict(d) for d in self.databases],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Matrix:
        """Read ``matrix.json``; raises ``ValueError`` for another layout."""
        if data.get("schema") != SCHEMA:
            raise ValueError(f"unsupported matrix.json schema {data.get('schema')!r}")
        return cls(
            generated_at=str(data.get("generated_at", "")),
            suites=[str(s) for s in data.get("suites", [])],
            sources=[Source.from_dict(s) for s in data.get("sources", [])],
            databases=[Database.from_dict(d) for d in data.get("databases", [])],
        )
