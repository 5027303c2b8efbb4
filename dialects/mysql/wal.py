"""The MySQL/MariaDB dialect's log tailing, where the registry looks for it: the binlog."""

from __future__ import annotations

import outbox_core.dialects.mysql.binlog  # noqa: F401  (registers the binlog's tailing)
