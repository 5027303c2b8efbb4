"""A ready ``json_default`` for payloads: Decimal, datetime, UUID, dataclasses, pydantic, enums.

>>> outbox = Outbox(url, json_default=encode_value)

Pass your own function instead where your consumers expect another form
(``json.dumps``'s ``default``: take the value, return something JSON holds,
raise ``TypeError`` for what you do not handle).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import enum
import uuid
from typing import Any


def encode_value(value: Any) -> Any:
    """The JSON form of the everyday values JSON has no type for.

    * ``Decimal`` -> a string (``"12.50"``): exact, as money must be;
    * ``datetime``, ``date``, ``time`` -> ISO 8601 (``2026-11-24T10:00:00+00:00``);
    * ``timedelta`` -> seconds, a number;
    * ``UUID`` -> its string;
    * an ``Enum`` member -> its value;
    * a dataclass instance -> a dict of its fields;
    * a pydantic model -> ``model_dump(mode="json")``;
    * ``set`` / ``frozenset`` -> a list; ``bytes`` are refused (say how to encode them).
    """
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    dump = getattr(value, "model_dump", None)  # pydantic 2, without importing it
    if callable(dump):
        return dump(mode="json")
    if isinstance(value, set | frozenset):
        return sorted(value, key=repr)
    raise TypeError(
        f"{type(value).__name__} has no JSON form here"
        + (" (encode bytes as base64 text first)" if isinstance(value, bytes) else "")
    )
