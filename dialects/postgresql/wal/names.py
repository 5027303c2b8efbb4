"""LSNs, slot names and URLs as PostgreSQL spells them; the default slot of a table."""

from __future__ import annotations

import re

import sqlalchemy as sa

from outbox_core.config import Settings
from outbox_core.errors import ConfigurationError
from outbox_core.identifiers import validate_identifier
from outbox_core.redaction import redact

#: The publication of ``outbox install --source wal``: inserts, and updates for replays.
PUBLISH = ("insert", "update")

_SLOT_NAME = re.compile(r"[a-z0-9_]{1,63}")


_SLOT_NAME = re.compile(r"[a-z0-9_]{1,63}")


def parse_lsn(text: str) -> int:
    """``'16/B374D848'`` -> int."""
    high, sep, low = text.partition("/")
    try:
        if not sep:
            raise ValueError(text)
        return (int(high, 16) << 32) | int(low, 16)
    except ValueError:
        raise ConfigurationError(f"invalid LSN {text!r}: expected hex 'X/Y'") from None


def format_lsn(lsn: int) -> str:
    """int -> ``'16/B374D848'`` (PostgreSQL's spelling)."""
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def lsn_or_none(value: object) -> int | None:
    """:func:`parse_lsn` of a column's text, None kept."""
    return None if value is None else parse_lsn(str(value))


def validate_slot_name(name: str) -> str:
    """PostgreSQL's own rule for slot names: 1-63 lower-case letters, digits, underscores."""
    if not isinstance(name, str) or not _SLOT_NAME.fullmatch(name):
        raise ConfigurationError(
            f"invalid replication slot name {name!r}: use 1-63 lower-case letters, "
            "digits or underscores"
        )
    return name


def quote_identifier(name: str, what: str) -> str:
    """A validated identifier, double-quoted (the case it was written in is kept)."""
    return '"' + validate_identifier(name, what) + '"'


def masked_url(url: str | sa.URL) -> str:
    """The URL with its password hidden: what errors and logs may show."""
    try:
        return sa.engine.make_url(url).render_as_string(hide_password=True)
    except sa.exc.ArgumentError:
        return redact(str(url))


def wal_names(settings: Settings) -> tuple[str, str]:
    """The slot and publication: the settings' or ``outbox_<table>`` (lower-case)."""
    default = f"outbox_{settings.table.lower()}"[:63]
    return validate_slot_name(settings.slot or default), settings.publication or default


def wal_distance(n: int) -> str:
    """A WAL distance in bytes, for a log line."""
    if n < 1024:
        return f"{n} B"
    if n < 1 << 20:
        return f"{n / 1024:.1f} KiB"
    return f"{n / (1 << 20):.1f} MiB"
