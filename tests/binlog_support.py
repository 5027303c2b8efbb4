"""A private MariaDB with the binlog on (ROW, FULL images, strict GTIDs) for the binlog tests.

:class:`BinlogMariaDB` is :class:`~tests.faults.private_servers.PrivateMariaDB`
started with ``--log-bin`` and the settings ``--source binlog`` needs (or
some left out, for the install's refusals). The machine's shared MariaDB is
never touched.
"""

from __future__ import annotations

from tests.faults.private_servers import PrivateMariaDB

#: What ``outbox install --source binlog`` checks for.
BINLOG_OPTIONS = (
    "--log-bin=mariadb-bin", "--binlog-format=ROW", "--binlog-row-image=FULL",
    "--binlog-row-metadata=FULL",
    "--server-id=1", "--gtid-strict-mode=1", "--gtid-domain-id=0",
)  # fmt: skip


class BinlogMariaDB(PrivateMariaDB):
    """A private MariaDB whose binlog a log-tailing relay can read (``options``: its flags)."""

    def __init__(self, options: tuple[str, ...] = BINLOG_OPTIONS) -> None:
        super().__init__(options)
