"""Logging of the ``outbox`` command: stderr, text or JSON lines, passwords masked."""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any

from outbox_core.redaction import redact


class RedactingFilter(logging.Filter):
    """Masks ``user:password@`` (any URL shape) in every log record, whoever logged it."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Rewrite the record's message with passwords masked."""
        message = record.getMessage()
        masked = redact(message)
        if masked != message:
            record.msg, record.args = masked, None
        return True


class TextFormatter(logging.Formatter):
    """``time LEVEL logger: message``, the whole line masked (a traceback's URLs too)."""

    def format(self, record: logging.LogRecord) -> str:
        """Render ``record`` as text, then mask any ``user:password@`` in it."""
        return redact(super().format(record))


class JsonFormatter(logging.Formatter):
    """One JSON object per line, with the record's ``extra`` fields."""

    _STANDARD = set(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        """Render ``record`` as JSON."""
        data: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in self._STANDARD:
                # extra fields are masked too: a URL may travel in one
                data[key] = redact(value) if isinstance(value, str) else value
        if record.exc_info:
            data["exception"] = redact(self.formatException(record.exc_info))
        return json.dumps(data, default=str)


def setup_logging(verbose: int, json_logs: bool) -> None:
    """Log to stderr, passwords masked."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RedactingFilter())
    handler.setFormatter(
        JsonFormatter()
        if json_logs
        else TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    logging.getLogger("outbox").setLevel(logging.DEBUG if verbose > 1 else logging.INFO)
