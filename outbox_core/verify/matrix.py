"""Merge ``outbox verify --json`` rows into one compatibility matrix (Markdown).

``outbox matrix row-*.json`` prints it (a CI job summary, ``docs/ci.md``);
the project's own ``compat_matrix/MATRIX.md`` is rendered by the same code.
Guarantees run down the table, servers across; a cell is ``pass``,
``**FAIL**`` or ``skip``, with a numbered note giving a failure's or a skip's
reason.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

_MARK = {"pass": "pass", "fail": "**FAIL**", "skip": "skip"}


def load_rows(paths: Iterable[str | Path]) -> list[dict[str, Any]]:
    """Read ``outbox verify --json`` outputs (a row each, or a JSON list of rows)."""
    rows: list[dict[str, Any]] = []
    for path in paths:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        rows.extend(data if isinstance(data, list) else [data])
    return rows


def column_name(row: dict[str, Any]) -> str:
    """The server as the column is titled: product and version."""
    return f"{row['server']} {row['version']}".strip()


def render_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The matrix: one row per guarantee, one column per server, then the notes."""
    if not rows:
        return "No `outbox verify` rows to merge.\n"
    guarantees: dict[str, str] = {}
    for row in rows:
        for result in row["results"]:
            guarantees.setdefault(result["name"], result["guarantee"])
    notes: list[str] = []

    def cell(row: dict[str, Any], name: str) -> str:
        result = next((r for r in row["results"] if r["name"] == name), None)
        if result is None:
            return "—"
        mark = str(_MARK.get(result["status"], result["status"]))
        if result["status"] == "pass" or not result.get("detail"):
            return mark
        notes.append(f"{column_name(row)}, `{name}`: {_one_line(result['detail'])}")
        return f"{mark} [{len(notes)}]"

    header = ["guarantee", *(column_name(r) for r in rows)]
    lines = [_row(header), _row(["---"] * len(header))]
    for name, words in guarantees.items():
        lines.append(_row([f"`{name}`: {words}", *(cell(r, name) for r in rows)]))
    lines.append(_row(["time", *(f"{r['seconds']:.0f} s ({r['mode']})" for r in rows)]))
    verdicts = ", ".join(
        f"{column_name(r)}: {'ok' if r.get('ok', True) else 'FAILED'}" for r in rows
    )
    out = [*lines, "", verdicts]
    if notes:
        out += ["", *(f"{i}. {note}" for i, note in enumerate(notes, 1))]
    return "\n".join(out) + "\n"


def _row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _one_line(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")
