"""A private MariaDB with the binlog on (ROW, FULL images, strict GTIDs) for the binlog tests.

:class:`BinlogMariaDB` is :class:`~tests.faults.private_servers.PrivateMariaDB`
started with ``--log-bin`` and the settings ``--source binlog`` needs (or
some left out, for the install's refusals). The machine's shared MariaDB is
never touched.
"""

from __future__ import annotations

import os
import subprocess
import time

import sqlalchemy as sa

from tests.faults.private_servers import PrivateMariaDB

#: What ``outbox install --source binlog`` checks for.
BINLOG_OPTIONS = (
    "--log-bin=mariadb-bin", "--binlog-format=ROW", "--binlog-row-image=FULL",
    "--binlog-row-metadata=FULL",
    "--server-id=1", "--gtid-strict-mode=1", "--gtid-domain-id=0",
)  # fmt: skip


def wait_until_up(url: str, timeout: float) -> float:
    """Seconds until ``url`` answers ``SELECT 1`` (raises after ``timeout``)."""
    started = time.monotonic()
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        while True:
            try:
                with engine.connect() as conn:
                    conn.execute(sa.text("SELECT 1"))
                return time.monotonic() - started
            except sa.exc.OperationalError:
                if time.monotonic() - started > timeout:
                    raise
                time.sleep(0.05)
    finally:
        engine.dispose()


class BinlogMariaDB(PrivateMariaDB):
    """A private MariaDB whose binlog a log-tailing relay can read (``options``: its flags)."""

    def __init__(self, options: tuple[str, ...] = BINLOG_OPTIONS) -> None:
        super().__init__()
        self.options = options

    def start(self) -> float:
        """Start ``mariadbd`` with the binlog options; seconds until it answers."""
        args = [
            "mariadbd", "--no-defaults", f"--datadir={self.data}", f"--port={self.port}",
            f"--socket={self.socket}", "--bind-address=127.0.0.1", f"--log-error={self.log}",
            f"--pid-file={self.root / 'mysqld.pid'}", "--innodb-buffer-pool-size=64M",
            "--innodb-flush-log-at-trx-commit=2", "--skip-name-resolve", *self.options,
        ]  # fmt: skip
        if os.geteuid() == 0:
            args.append(f"--user={self.user}")
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        server = self.url.rsplit("/", 1)[0] + "/"
        took = wait_until_up(server, 60)
        engine = sa.create_engine(server, poolclass=sa.pool.NullPool)
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE DATABASE IF NOT EXISTS test"))
        engine.dispose()
        return took
