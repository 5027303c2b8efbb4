"""What SQLite stores: any length, timestamps as the text the toolkit writes."""

from __future__ import annotations

from typing import Any, ClassVar

from outbox_core.dialects.base import StorageRules


class SqliteStorage(StorageRules):
    """SQLite's storage rules."""

    #: Declared lengths are not limits: SQLite keeps any length it is given.
    enforces_lengths: ClassVar[bool] = False

    def time_digits(self, column_type: Any) -> int:
        """Timestamps are the text the toolkit writes: microseconds."""
        return 6
