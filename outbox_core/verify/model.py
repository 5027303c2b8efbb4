"""What ``outbox verify`` concludes: a check's verdict and the matrix row of verdicts."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


class Skip(Exception):
    """The guarantee does not apply to this database; the message says why."""


class Failed(AssertionError):
    """The guarantee does not hold; the message says what was seen."""


@dataclass
class Result:
    """One guarantee's verdict."""

    name: str
    guarantee: str
    status: str  # "pass", "fail" or "skip"
    seconds: float
    detail: str = ""


@dataclass
class Report:
    """One row of the compatibility matrix."""

    url: str
    server: str
    version: str
    mode: str
    results: list[Result] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """True when no guarantee failed."""
        return all(r.status != "fail" for r in self.results)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {**asdict(self), "ok": self.ok}
