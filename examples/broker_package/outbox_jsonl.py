"""An outbox-toolkit broker from another package: events appended to a JSON Lines file.

``jsonl:///var/spool/events.jsonl``: each event one line (``event_id``,
``topic``, ``key``, ``headers``, ``payload``), the batch written and fsynced
before any event is ``ok``. A payload JSON cannot carry (NaN) is ``reject``;
a file that cannot be opened or written (its directory gone, a full disk) is
an outage: ``unavailable``, no attempt spent.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

from outbox_core.brokers.base import Broker
from outbox_core.errors import ConfigurationError
from outbox_core.message import Event, Outcome


class JsonLinesBroker(Broker):
    """Appends each batch to one file, fsynced before the outcomes are ``ok``."""

    unavailable_errors = (OSError,)

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def from_url(cls, url: str, **options: Any) -> JsonLinesBroker:
        """``jsonl:///absolute/path.jsonl``; this broker takes no options."""
        if options:
            raise ConfigurationError(f"jsonl broker: unknown options {sorted(options)}")
        path = unquote(urlsplit(url).path)
        if not path:
            raise ConfigurationError("jsonl broker: the URL names no file (jsonl:///path)")
        return cls(path)

    def publish(self, events: Sequence[Event]) -> Sequence[Outcome]:
        """Write the lines of the events JSON can carry, fsync, then say ``ok``."""
        if not events:
            return []
        outcomes: list[Outcome | None] = [None] * len(events)
        lines: list[str] = []
        for index, event in enumerate(events):
            record = {
                "event_id": event.event_id,
                "topic": event.topic,
                "key": event.key,
                "headers": dict(event.headers),
                "payload": event.payload,
            }
            try:
                lines.append(json.dumps(record, allow_nan=False) + "\n")
            except (TypeError, ValueError) as exc:
                outcomes[index] = Outcome.reject(f"not JSON: {exc}")
        with self._lock:
            if self._closed:
                return [Outcome.unavailable("jsonl broker is closed")] * len(events)
            try:
                with open(self.path, "a", encoding="utf-8") as file:
                    file.writelines(lines)
                    file.flush()
                    os.fsync(file.fileno())
            except OSError as exc:
                return [Outcome.unavailable(f"cannot write {self.path}: {exc.strerror}")] * len(
                    events
                )
        return [o if o is not None else Outcome.ok() for o in outcomes]

    def probe(self) -> str | None:
        """None when the file's directory can be written to, else why not."""
        directory = os.path.dirname(self.path) or "."
        if not os.access(directory, os.W_OK):
            return f"cannot write to {directory}"
        return None

    def close(self) -> None:
        """Later publishes are ``unavailable``."""
        with self._lock:
            self._closed = True
