"""What each database family brings to ``outbox doctor``, registered from its ``doctor`` module.

A family's ``doctor.py`` (beside its dialect) defines ``DOCTOR``, a
:class:`FamilyDoctor`: its own checks (isolation, WAL, vacuum, engines, ...),
how its claims keep apart, the fix when its server is too old, and a
preflight that runs before connecting. A family without one gets the defaults.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from outbox_core.dialects.base.companions import companion
from outbox_core.doctor.model import DoctorContext, Finding

if TYPE_CHECKING:
    from sqlalchemy.engine import URL

    from outbox_core.dialects.base import Dialect

#: One check: findings about the database behind a doctor's context.
Check = Callable[[DoctorContext], Iterable[Finding]]


@dataclass(frozen=True)
class FamilyDoctor:
    """A database family's part of ``outbox doctor``."""

    #: Its own checks, by finding name.
    checks: Sequence[tuple[str, Check]] = ()
    #: How concurrent claims keep apart, for people.
    locking: str = "claims skip each other's rows"
    #: The fix when the dialect's ``check`` refuses the server.
    upgrade_hint: str | None = None
    #: A primary key can be added to an existing table (SQLite cannot).
    can_add_primary_key: bool = True
    #: ``(url, install command) -> finding``: a problem to report instead of
    #: connecting at all (SQLite: a mistyped file name would create a new database).
    preflight: Callable[[URL, str], Finding | None] | None = None


def family_doctor(dialect: Dialect) -> FamilyDoctor:
    """The ``DOCTOR`` of ``dialect``'s family, or the defaults."""
    found = getattr(companion(type(dialect), "doctor"), "DOCTOR", None)
    return found if isinstance(found, FamilyDoctor) else FamilyDoctor()
