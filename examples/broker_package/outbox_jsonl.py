"""An outbox-toolkit broker from another package: events appended to a JSON Lines file.

``jsonl:///var/spool/events.jsonl``: each event one line (``event_id``,
``topic``, ``key``, ``headers``, ``payload``), the batch written with one
append under an exclusive lock (several relays may share the file) and
fsynced before any event is ``ok``. A payload JSON cannot carry (NaN) is
``reject``; a file that cannot be opened or written (its directory gone, a
full disk) is an outage: ``unavailable``, no attempt spent, and a batch
written in part is cut off again.
"""

from __future__ import annotations

import fcntl
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
        parts = urlsplit(url)
        if parts.netloc:
            raise ConfigurationError(
                f"jsonl broker: {parts.netloc!r} is not a path: use jsonl:///absolute/path"
            )
        path = unquote(parts.path)
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
                self._append("".join(lines).encode())
            except OSError as exc:
                reason = f"cannot write {self.path}: {exc.strerror or exc}"
                return [Outcome.unavailable(reason)] * len(events)
        return [o if o is not None else Outcome.ok() for o in outcomes]

    def _append(self, data: bytes) -> None:
        """Append ``data`` durably, or leave the file as it was."""
        created = not os.path.exists(self.path)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # other relays' batches stay whole lines
            start = os.lseek(fd, 0, os.SEEK_END)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            except OSError:
                os.ftruncate(fd, start)  # no torn line, no half batch left behind
                raise
        finally:
            os.close(fd)  # releases the lock
        if created:  # the new file's name is durable too
            dir_fd = os.open(os.path.dirname(self.path) or ".", os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)

    def probe(self) -> str | None:
        """None when the file (or, before the first batch, its directory) can be written."""
        target = self.path if os.path.exists(self.path) else os.path.dirname(self.path) or "."
        if not os.access(target, os.W_OK):
            return f"cannot write to {target}"
        return None

    def close(self) -> None:
        """Later publishes are ``unavailable``."""
        with self._lock:
            self._closed = True
