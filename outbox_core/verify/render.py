"""The matrix row as text for people, JSON for tools (``outbox matrix``) and JUnit XML for CI."""

from __future__ import annotations

import json
from typing import Any
from xml.etree import ElementTree

from outbox_core.verify.model import Report


def render_text(report: Report) -> str:
    """The matrix row for people."""
    lines = [f"{report.server} {report.version}  ({report.url}, {report.mode})"]
    for r in report.results:
        line = f"  {r.status.upper():<5} {r.name:<17} {r.guarantee}"
        if r.detail:
            line += f"\n        {r.detail}"
        lines.append(line)
    failed = sum(r.status == "fail" for r in report.results)
    skipped = sum(r.status == "skip" for r in report.results)
    passed = len(report.results) - failed - skipped
    lines.append(f"{passed} passed, {failed} failed, {skipped} skipped in {report.seconds:.1f}s")
    return "\n".join(lines)


def render_json(report: Report, **extra: Any) -> str:
    """The row as indented JSON, with ``extra`` top-level fields (``outbox verify --json``)."""
    return json.dumps({**report.as_dict(), **extra}, indent=2, default=str)


def render_junit(report: Report) -> str:
    """The row as JUnit XML (one test case per guarantee), for CI systems."""
    suite = ElementTree.Element(
        "testsuite",
        name=f"outbox verify {report.server} {report.version}",
        tests=str(len(report.results)),
        failures=str(sum(r.status == "fail" for r in report.results)),
        skipped=str(sum(r.status == "skip" for r in report.results)),
        time=f"{report.seconds:.3f}",
    )
    for r in report.results:
        case = ElementTree.SubElement(
            suite,
            "testcase",
            classname=f"{report.server} {report.version}",
            name=r.name,
            time=f"{r.seconds:.3f}",
        )
        if r.status == "fail":
            ElementTree.SubElement(case, "failure", message=r.detail).text = r.guarantee
        elif r.status == "skip":
            ElementTree.SubElement(case, "skipped", message=r.detail)
    return ElementTree.tostring(suite, encoding="unicode")
