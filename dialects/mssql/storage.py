"""What SQL Server counts differently: NVARCHAR lengths in UTF-16 units, DATETIME precision."""

from __future__ import annotations

from typing import Any

from outbox_core.dialects.base import StorageRules


class MssqlStorage(StorageRules):
    """SQL Server's storage rules."""

    def text_length(self, value: str) -> int:
        """UTF-16 code units: a character outside the BMP takes two of NVARCHAR's length."""
        return len(value.encode("utf-16-le")) // 2

    def time_digits(self, column_type: Any) -> int:
        """DATETIME rounds to 1/300 s (no digits kept exactly); DATETIME2 keeps its precision."""
        if type(column_type).__name__.upper() != "DATETIME2":
            return 0
        return super().time_digits(column_type)
