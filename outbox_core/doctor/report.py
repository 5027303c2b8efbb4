"""How ``outbox doctor`` reports: text for people, JSON for scripts, the exit code."""

from __future__ import annotations

import textwrap
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from outbox_core.doctor.model import Finding, Severity
from outbox_core.redaction import mask_url

if TYPE_CHECKING:
    from outbox_core.outbox import Outbox


def exit_code(findings: Iterable[Finding], *, strict: bool = False) -> int:
    """1 when a finding is an error (or a warning, with ``strict``), else 0."""
    bad = {Severity.ERROR, Severity.WARNING} if strict else {Severity.ERROR}
    return 1 if any(f.severity in bad for f in findings) else 0


def _counts(findings: list[Finding]) -> dict[str, int]:
    return {str(s): sum(1 for f in findings if f.severity == s) for s in Severity}


def render_report(findings: list[Finding], *, title: str | None = None) -> str:
    """The findings as a readable report, worst first, each with its fix."""
    labels = {Severity.OK: "ok", Severity.WARNING: "WARNING", Severity.ERROR: "ERROR"}
    lines = [title, ""] if title else []
    indent = " " * 28
    for f in findings:
        head = f"{labels[f.severity]:<8} {f.check:<18} "
        lines.append(
            textwrap.fill(f.message, width=100, initial_indent=head, subsequent_indent=indent)
        )
        if f.fix:
            # Never wrapped: a fix is often a statement to copy and paste.
            lines.append(f"{indent}fix: {f.fix}")
    counts = _counts(findings)
    lines.append("")
    lines.append(f"{counts['error']} error(s), {counts['warning']} warning(s), {counts['ok']} ok")
    return "\n".join(lines)


def report_dict(outbox: Outbox, findings: list[Finding], *, strict: bool = False) -> dict[str, Any]:
    """The JSON form of ``outbox doctor --json``."""
    return {
        "database": mask_url(outbox.url),
        "dialect": outbox.dialect.name,
        "table": outbox.table.fullname,
        "healthy": exit_code(findings, strict=strict) == 0,
        "strict": strict,
        "summary": _counts(findings),
        "findings": [f.as_dict() for f in findings],
    }
