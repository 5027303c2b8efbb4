"""SQL identifiers the toolkit writes into DDL and statements: plain names only."""

from __future__ import annotations

import re

from outbox_core.errors import InvalidIdentifier

# Long enough for real names, short enough that index names stay under
# PostgreSQL's 63-character limit.
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,47}")


def validate_identifier(name: str, what: str = "table name") -> str:
    """Return ``name`` if it is a plain identifier, else raise :class:`InvalidIdentifier`."""
    if not isinstance(name, str) or not _IDENTIFIER.fullmatch(name):
        raise InvalidIdentifier(
            f"invalid {what} {name!r}: use 1-48 letters, digits or underscores, "
            "not starting with a digit"
        )
    return name
