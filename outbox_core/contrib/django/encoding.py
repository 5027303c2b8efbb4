"""The default ``settings.OUTBOX["ENCODER"]``: Django's types, the core's forms.

A Django producer and a plain one (``Outbox(json_default=encode_value)``)
writing to one topic emit the same bytes for the same values: datetimes as
``datetime.isoformat()`` (microseconds, ``+00:00``), where Django's
``DjangoJSONEncoder`` writes milliseconds and ``Z``.
"""

from __future__ import annotations

from typing import Any

from django.core.serializers.json import DjangoJSONEncoder
from django.utils.functional import Promise

from outbox_core.encoding import encode_value


class OutboxJSONEncoder(DjangoJSONEncoder):
    """The core's :func:`~outbox_core.encoding.encode_value`, and Django's lazy strings.

    * ``datetime``, ``date``, ``time`` -> ISO 8601 as ``isoformat()`` writes it
      (``2026-11-24T10:00:00.123456+00:00``; a naive datetime without offset);
    * ``Decimal`` -> its string; ``UUID`` -> its string;
    * ``timedelta`` -> seconds, a number (``DjangoJSONEncoder``: an ISO 8601 duration);
    * enums, dataclasses, pydantic models, sets: as the core encodes them;
    * a lazy translation (``gettext_lazy``) -> its text, as ``DjangoJSONEncoder``.
    """

    def default(self, o: Any) -> Any:
        """The JSON form of ``o``; ``TypeError`` for what neither side handles."""
        if isinstance(o, Promise):
            return str(o)
        return encode_value(o)
