"""``outbox verify``'s log-tailing rows (``wal-*``) on MariaDB's binlog (``--source binlog``).

The server with the binlog on is the module's own (:class:`~tests.binlog_support.BinlogMariaDB`,
removed afterwards); the shared MariaDB (no binlog) shows the skip. Covered:

* ``outbox verify --only`` each of ``wal-commit-order``, ``wal-at-least-once``
  and ``wal-relay`` passes on the binlog (the command, as a process), and no
  ``outbox_verify_*`` table is left behind;
* on the shared MariaDB without the binlog they skip naming ``log_bin`` and
  what to set, exit 0;
* a progress table a dead verify run left behind is dropped by the next
  check, one a live check holds (its named lock) is not.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa

from outbox_core.dialects.mysql.binlog.scratch import check_lock
from outbox_core.verify import verify
from tests.binlog_support import BinlogMariaDB
from tests.conftest import reachable_url
from tests.support import outbox_cli

pytestmark = pytest.mark.needs_server

WAL_ROWS = ["wal-commit-order", "wal-at-least-once", "wal-relay"]


def leftovers(url: str) -> list[str]:
    """Verify's tables still in the database (outbox tables and their ``_wal``)."""
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            names = sa.inspect(conn).get_table_names()
        return sorted(t for t in names if t.startswith("outbox_verify_"))
    finally:
        engine.dispose()


@pytest.mark.parametrize("row", WAL_ROWS)
def test_outbox_verify_only_each_row_passes_on_the_binlog(
    binlog_server: BinlogMariaDB, row: str
) -> None:
    started = time.monotonic()
    done = outbox_cli("verify", "--db", binlog_server.url, "--quick", "--only", row)
    took = time.monotonic() - started
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert f"PASS  {row}" in out, out
    assert "1 passed, 0 failed, 0 skipped" in out, out
    print(f"{row} on the binlog: {took:.1f}s")
    assert leftovers(binlog_server.url) == []


def test_without_the_binlog_the_rows_skip_naming_what_to_set(tmp_path: Path) -> None:
    url = reachable_url("mysql", tmp_path)
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    with engine.connect() as conn:
        log_bin = conn.execute(sa.text("SELECT @@global.log_bin")).scalar()
    engine.dispose()
    if str(log_bin) in ("1", "ON"):
        pytest.skip("the shared MariaDB has its binlog on: nothing to skip")
    # A skip is not a failure: the command exits 0 and says why, for each row.
    rows = [arg for name in WAL_ROWS for arg in ("--only", name)]
    done = outbox_cli("verify", "--db", url, "--quick", "--only", "atomic", *rows)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "PASS  atomic" in out, out
    for row in WAL_ROWS:
        assert f"SKIP  {row}" in out, out
    assert out.count("log_bin is OFF: start the server with --log-bin") == len(WAL_ROWS), out
    assert "1 passed, 0 failed, 3 skipped" in out, out


def test_a_source_a_dead_run_left_is_dropped_and_a_live_one_is_not(
    binlog_server: BinlogMariaDB,
) -> None:
    engine = sa.create_engine(binlog_server.url, poolclass=sa.pool.NullPool)
    abandoned = f"outbox_verify_{uuid.uuid4().hex[:10]}"
    live = f"outbox_verify_{uuid.uuid4().hex[:10]}"
    with engine.begin() as conn:
        for name in (abandoned, live):
            conn.execute(sa.text(f"CREATE TABLE {name}_wal (slot VARCHAR(63) PRIMARY KEY)"))
            conn.execute(sa.text(f"INSERT INTO {name}_wal VALUES ('{name}')"))
    holder = engine.connect()
    try:
        # A live check holds the named lock of its table for as long as it runs.
        got = holder.execute(
            sa.text("SELECT GET_LOCK(:n, 0)"), {"n": check_lock("test", live)}
        ).scalar()
        assert got == 1
        report = verify(binlog_server.url, mode="quick", only=["wal-commit-order"])
        [result] = report.results
        assert result.status == "pass", result
        assert f"dropped 1 abandoned verify slot(s): {abandoned}" in result.detail
        assert leftovers(binlog_server.url) == [f"{live}_wal"]
    finally:
        holder.close()
        with engine.begin() as conn:
            for name in (abandoned, live):
                conn.execute(sa.text(f"DROP TABLE IF EXISTS {name}_wal"))
        engine.dispose()
    assert leftovers(binlog_server.url) == []
