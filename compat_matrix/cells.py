"""Turn per-test results into cells: one verdict per feature and database.

The rules, per cell:

* **fail**: a mapped test failed, or the run broke (timeout, crash, collection
  error) before reporting a mapped test.
* **pass**: every mapped test ran and passed, and every test the row names
  exactly was reported.
* **partial**: some mapped tests passed, the others were skipped or not
  reported (the reason says which and why). Not a failure.
* **not run**: nothing ran: the server was unreachable or unsupported, the
  suite is missing or collected nothing, or every mapped test was skipped
  (the skip reasons are given).
* **empty**: an "other tests" row with no unmapped test on that database.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from compat_matrix.features import Feature, features_for, other_feature, pattern_matches
from compat_matrix.model import (
    ERROR,
    FAILED,
    OK,
    PASSED,
    RAN,
    SKIPPED,
    UNSUPPORTED,
    Cell,
    Database,
    Matrix,
    SuiteRun,
    TestResult,
    parse_nodeid,
)

PASS = "pass"
FAIL = "fail"
PARTIAL = "partial"
NOT_RUN = "not run"
EMPTY = "empty"
#: Cell statuses, best first.
STATUSES: tuple[str, ...] = (PASS, PARTIAL, NOT_RUN, EMPTY, FAIL)


@dataclass
class Row:
    """One rendered row: a feature and its cell per database key."""

    feature: Feature
    cells: dict[str, Cell]
    #: every test of the row ran without the ``backend`` fixture (no database involved)
    no_database: bool = False
    #: node ids (without the database parameter) of the tests seen for this row
    tests: list[str] = field(default_factory=list)


@dataclass
class Table:
    """All rows of a matrix, plus warnings about the mapping."""

    rows: list[Row]
    warnings: list[str]

    def counts(self) -> dict[str, int]:
        """Cells per status."""
        counts = dict.fromkeys(STATUSES, 0)
        for row in self.rows:
            for cell in row.cells.values():
                counts[cell.status] = counts.get(cell.status, 0) + 1
        return counts

    def failed(self) -> bool:
        """True when any cell failed."""
        return any(c.status == FAIL for row in self.rows for c in row.cells.values())


def _matches(
    feature: Feature, siblings: list[Feature], function: str, qualname: str, params: str
) -> bool:
    if feature.other:
        return not any(s.matches(function, qualname, params) for s in siblings)
    return feature.matches(function, qualname, params)


def _test_matches(feature: Feature, siblings: list[Feature], test: TestResult) -> bool:
    return _matches(feature, siblings, test.function, test.qualname, test.params)


def _unreported(feature: Feature, siblings: list[Feature], run: SuiteRun) -> list[str]:
    """Collected node ids of this row that the run never reported."""
    reported = {t.nodeid for t in run.tests}
    return [
        n
        for n in run.collected
        if n not in reported and _matches(feature, siblings, *parse_nodeid(n))
    ]


def _missing_names(feature: Feature, run: SuiteRun) -> list[str]:
    """Exact patterns of the row that match no reported, collected or deselected test."""
    seen = [(t.function, t.qualname, t.params) for t in run.tests]
    seen += [parse_nodeid(n) for n in [*run.collected, *run.deselected]]
    return [p for p in feature.exact_names() if not any(pattern_matches(p, *s) for s in seen)]


def _deselected(feature: Feature, run: SuiteRun) -> list[str]:
    """Node ids of this row left out by ``-k`` / ``-m`` (never for "other tests")."""
    if feature.other:
        return []
    return [n for n in run.deselected if feature.matches(*parse_nodeid(n))]


def _short(items: Iterable[str], limit: int = 3) -> str:
    unique = list(dict.fromkeys(i for i in items if i))
    text = "; ".join(unique[:limit])
    if len(unique) > limit:
        text += f"; and {len(unique) - limit} more"
    return text


def _first_line(text: str, width: int = 200) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= width else line[: width - 1] + "…"


def feature_cell(feature: Feature, siblings: list[Feature], db: Database) -> Cell:
    """The verdict of ``feature`` on ``db`` (see the module docstring)."""
    if db.status != OK:
        what = "unsupported" if db.status == UNSUPPORTED else "server unreachable"
        return Cell(NOT_RUN, f"{what}: {db.reason}")
    run = db.runs.get(feature.suite)
    if run is None:
        return Cell(NOT_RUN, "suite not selected")
    if run.status not in (RAN, ERROR):
        return Cell(NOT_RUN, run.reason or run.status)

    matched = [t for t in run.tests if _test_matches(feature, siblings, t)]
    tests = {t.nodeid: t.outcome for t in matched}
    failed = [t for t in matched if t.outcome == FAILED]
    passed = [t for t in matched if t.outcome == PASSED]
    skipped = [t for t in matched if t.outcome == SKIPPED]
    unreported = _unreported(feature, siblings, run)
    missing = [] if feature.other else _missing_names(feature, run)
    deselected = _deselected(feature, run)
    for nodeid in unreported:
        tests[nodeid] = "not reported"

    if failed:
        failures = {t.nodeid: t.message for t in failed}
        first = failed[0]
        reason = f"{first.nodeid.rpartition('::')[2]}: {_first_line(first.message)}"
        if len(failed) > 1:
            reason += f" (and {len(failed) - 1} more failed)"
        return Cell(FAIL, reason, tests, failures)
    if run.status == ERROR and (unreported or missing or not (matched or deselected)):
        names = [n.rpartition("::")[2] for n in unreported] + missing
        reason = run.reason
        if names:
            reason += f"; not reported: {_short(names)}"
        return Cell(FAIL, reason, tests)
    if not matched and not unreported and not missing and not deselected:
        if feature.other:
            return Cell(EMPTY, "", tests)
        return Cell(NOT_RUN, f"no test matches {', '.join(feature.tests)}", tests)

    notes: list[str] = []
    if missing:
        notes.append(f"not collected: {_short(missing)} (renamed or removed?)")
    if unreported:
        names = [n.rpartition("::")[2] for n in unreported]
        notes.append(f"not reported: {_short(names)} (the run stopped early)")
    if deselected:
        names = [n.rpartition("::")[2] for n in deselected]
        notes.append(f"deselected by the pytest arguments: {_short(names)}")
    if skipped:
        notes.append("skipped: " + _short(t.message for t in skipped))
    if not notes:
        return Cell(PASS, "", tests)
    if not passed:
        return Cell(NOT_RUN, "; ".join(notes), tests)
    total = len(matched) + len(unreported) + len(missing) + len(deselected)
    return Cell(PARTIAL, f"{len(passed)} of {total} passed; " + "; ".join(notes), tests)


def _strip_backend(nodeid: str, backend: str) -> str:
    base, bracket, rest = nodeid.partition("[")
    if not bracket:
        return nodeid
    tokens = [t for t in rest.rstrip("]").split("-") if t != backend]
    return f"{base}[{'-'.join(tokens)}]" if tokens else base


def build_table(matrix: Matrix) -> Table:
    """Every row of ``matrix`` with its cells, and warnings about the mapping."""
    rows: list[Row] = []
    warnings: list[str] = []
    for suite in matrix.suites:
        siblings = features_for([suite])
        ran = [
            db.runs[suite]
            for db in matrix.databases
            if suite in db.runs and db.runs[suite].status in (RAN, ERROR)
        ]
        for feature in [*siblings, other_feature(suite)]:
            cells = {db.key: feature_cell(feature, siblings, db) for db in matrix.databases}
            if feature.other and not any(c.tests or c.status == FAIL for c in cells.values()):
                continue
            seen: dict[str, None] = {}
            uses_backend: list[bool] = []
            for db in matrix.databases:
                run = db.runs.get(suite)
                for test in run.tests if run else []:
                    if _test_matches(feature, siblings, test):
                        seen[_strip_backend(test.nodeid, db.backend)] = None
                        if not test.function.startswith("<"):  # not a collection error
                            uses_backend.append(test.uses_backend)
            no_db = bool(uses_backend) and not any(uses_backend)
            rows.append(Row(feature, cells, no_db, list(seen)))
        if not ran:
            continue
        for feature in siblings:
            for pattern in feature.tests:
                hit = any(
                    pattern_matches(pattern, t.function, t.qualname, t.params)
                    for run in ran
                    for t in run.tests
                ) or any(
                    pattern_matches(pattern, *parse_nodeid(n))
                    for run in ran
                    for n in [*run.collected, *run.deselected]
                )
                if not hit:
                    warnings.append(
                        f"feature {feature.id!r} ({suite}): pattern {pattern!r} matched no test "
                        "in any run: renamed or removed? (compat_matrix/features.py)"
                    )
    return Table(rows, warnings)
