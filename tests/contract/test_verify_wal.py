"""``outbox verify``'s log-tailing rows (``wal-*``): pass, skip with the reason, fail when broken.

The logical server is the module's own (``tests/faults/private_servers.py``,
``wal_level=logical``, removed afterwards); the shared PostgreSQL
(``wal_level=replica``) shows the skip. Covered:

* ``wal-commit-order``, ``wal-at-least-once`` and ``wal-relay`` pass on a
  logical server, in-process and through ``outbox verify --only``, and leave
  no slot, publication or table behind;
* on the shared server they skip naming ``wal_level`` (exit 0), and a role
  without REPLICATION skips naming it;
* a reader that hands out transactions in xid (id) order fails
  ``wal-commit-order`` and ``wal-relay``; one that confirms past everything
  it read fails ``wal-at-least-once`` and ``wal-relay``; the slot is
  dropped all the same;
* a slot a dead verify run left behind is dropped by the next WAL check, one
  a live check holds (its advisory lock) is not.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from outbox_core.dialects.postgresql.wal import (
    WalStream,
    WalTransaction,
    create_publication,
    create_slot,
    drop_publication,
    drop_slot,
)
from outbox_core.dialects.postgresql.wal.scratch import LOCK_CLASS
from outbox_core.verify import GUARANTEES, verify
from tests.conftest import BACKENDS, _probe, server_url, unavailable
from tests.faults.private_servers import PrivatePostgres
from tests.support import outbox_cli

pytestmark = pytest.mark.needs_server

WAL_ROWS = ["wal-commit-order", "wal-at-least-once", "wal-relay"]


def run(*args: str) -> tuple[int, str, str]:
    """``outbox ARGS``: its exit code, output and errors."""
    done = outbox_cli(*args)
    return done.returncode, done.stdout, done.stderr


@pytest.fixture
def shared(tmp_path: Path) -> str:
    """The shared PostgreSQL's URL (fails under CI=true when it does not answer)."""
    if "postgresql" not in BACKENDS:
        pytest.skip("OUTBOX_TEST_BACKENDS leaves PostgreSQL out")
    url = server_url("postgresql", tmp_path)
    if url is None:
        unavailable("postgresql", "set OUTBOX_TEST_POSTGRESQL_URL to run")
    assert url is not None
    reason = _probe(url)
    if reason is not None:
        unavailable("postgresql", reason)
    return url


def leftovers(url: str) -> dict[str, list[str]]:
    """Verify's slots, publications and tables still on the server."""
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            like = {"p": r"outbox\_verify\_%"}
            return {
                "slots": list(
                    conn.execute(
                        sa.text(
                            "SELECT slot_name FROM pg_replication_slots WHERE slot_name LIKE :p"
                        ),
                        like,
                    ).scalars()
                ),
                "publications": list(
                    conn.execute(
                        sa.text("SELECT pubname FROM pg_publication WHERE pubname LIKE :p"), like
                    ).scalars()
                ),
                "tables": [
                    t for t in sa.inspect(conn).get_table_names() if t.startswith("outbox_verify_")
                ],
            }
    finally:
        engine.dispose()


NOTHING_LEFT = {"slots": [], "publications": [], "tables": []}


def test_the_wal_rows_are_guarantees() -> None:
    names = [name for name, _, _ in GUARANTEES]
    assert set(WAL_ROWS) <= set(names)
    # The text render's name column is 17 wide.
    assert all(len(name) <= 17 for name in WAL_ROWS)


def test_the_wal_rows_pass_on_a_logical_server(logical_server: PrivatePostgres) -> None:
    started = time.monotonic()
    report = verify(logical_server.url, only=WAL_ROWS)
    took = time.monotonic() - started
    statuses = {r.name: (r.status, r.detail) for r in report.results}
    assert report.ok, statuses
    assert [r.name for r in report.results] == WAL_ROWS
    assert all(status == "pass" for status, _ in statuses.values()), statuses
    assert "in commit order" in statuses["wal-commit-order"][1]
    assert "2 retried, 1 rejected and 2 held dead" in statuses["wal-relay"][1]
    print(f"wal rows (default mode): {took:.1f}s; " + ", ".join(
        f"{r.name} {r.seconds:.1f}s" for r in report.results
    ))  # fmt: skip
    assert leftovers(logical_server.url) == NOTHING_LEFT


def test_outbox_verify_only_wal_commit_order(logical_server: PrivatePostgres) -> None:
    """The documented command, as a process."""
    code, out, err = run("verify", "--db", logical_server.url, "--only", "wal-commit-order")
    assert code == 0, out + err
    assert "PASS  wal-commit-order" in out
    assert "1 passed, 0 failed, 0 skipped" in out
    assert leftovers(logical_server.url) == NOTHING_LEFT


def test_on_a_server_without_logical_wal_the_rows_skip_naming_wal_level(shared: str) -> None:
    engine = sa.create_engine(shared, poolclass=sa.pool.NullPool)
    with engine.connect() as conn:
        level = conn.execute(sa.text("SHOW wal_level")).scalar()
    engine.dispose()
    if level == "logical":
        pytest.skip("the shared PostgreSQL has wal_level=logical: nothing to skip")
    report = verify(shared, mode="quick", only=WAL_ROWS)
    assert report.ok
    for result in report.results:
        assert result.status == "skip", result
        assert f"wal_level is {level!r}, logical decoding needs 'logical'" in result.detail
    # A skip is not a failure: the command exits 0 and says why.
    code, out, err = run(
        "verify", "--db", shared, "--quick", "--only", "atomic", *[
            arg for name in WAL_ROWS for arg in ("--only", name)
        ],
    )  # fmt: skip
    assert code == 0, out + err
    assert "PASS  atomic" in out and "SKIP  wal-commit-order" in out and "wal_level" in out
    assert "1 passed, 0 failed, 3 skipped" in out


def test_a_role_without_replication_skips_naming_it(logical_server: PrivatePostgres) -> None:
    admin = sa.create_engine(logical_server.url, poolclass=sa.pool.NullPool)
    with admin.begin() as conn:
        conn.execute(sa.text("DROP ROLE IF EXISTS verify_plain"))
        conn.execute(sa.text("CREATE ROLE verify_plain LOGIN NOREPLICATION"))
        conn.execute(sa.text("GRANT CREATE ON SCHEMA public TO verify_plain"))
    try:
        url = logical_server.url.replace("postgres@", "verify_plain@", 1)
        report = verify(url, only=["wal-commit-order", "atomic"])
        statuses = {r.name: (r.status, r.detail) for r in report.results}
        assert report.ok, statuses
        assert statuses["atomic"][0] == "pass"
        status, detail = statuses["wal-commit-order"]
        assert status == "skip" and "neither REPLICATION nor superuser" in detail
    finally:
        with admin.begin() as conn:
            conn.execute(sa.text("DROP OWNED BY verify_plain"))
            conn.execute(sa.text("DROP ROLE verify_plain"))
        admin.dispose()
    assert leftovers(logical_server.url) == NOTHING_LEFT


def _in_xid_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader that hands out what arrived together sorted by xid (id order), not commit order."""
    original = WalStream.read

    def read(self: WalStream, timeout: float) -> WalTransaction | None:
        held: list[WalTransaction] = self.__dict__.setdefault("_by_xid", [])
        if not held:
            txn = original(self, timeout)
            while txn is not None:
                held.append(txn)
                txn = original(self, 0.3)
            held.sort(key=lambda t: t.xid)
        return held.pop(0) if held else None

    monkeypatch.setattr(WalStream, "read", read)


def _confirming_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader whose confirm moves the slot past everything it read."""
    original = WalStream.confirm

    def confirm(self: WalStream, lsn: int) -> None:
        original(self, max(lsn, self.received_lsn))

    monkeypatch.setattr(WalStream, "confirm", confirm)


BREAKS: dict[str, Any] = {"xid-order": _in_xid_order, "confirm-all": _confirming_everything}


@pytest.mark.parametrize(
    ("breaks", "row", "says"),
    [
        ("xid-order", "wal-commit-order", "events came from the slot in the order"),
        ("xid-order", "wal-relay", "was delivered out of commit order"),
        ("confirm-all", "wal-at-least-once", "passed events read and not confirmed"),
        ("confirm-all", "wal-relay", "past an event still retrying"),
    ],
)
def test_a_broken_reader_fails_the_row_it_breaks_and_the_slot_is_dropped(
    logical_server: PrivatePostgres,
    monkeypatch: pytest.MonkeyPatch,
    breaks: str,
    row: str,
    says: str,
) -> None:
    BREAKS[breaks](monkeypatch)
    report = verify(logical_server.url, mode="quick", only=[row])
    assert not report.ok
    [result] = report.results
    assert result.name == row and result.status == "fail", result
    assert says in result.detail, result.detail
    assert leftovers(logical_server.url) == NOTHING_LEFT


def test_a_slot_a_dead_run_left_is_dropped_and_a_live_one_is_not(
    logical_server: PrivatePostgres,
) -> None:
    engine = sa.create_engine(logical_server.url, poolclass=sa.pool.NullPool)
    abandoned, live = "outbox_verify_deadbeef00", "outbox_verify_0000a11ce0"
    with engine.begin() as conn:
        for name in (abandoned, live):
            conn.execute(sa.text(f"CREATE TABLE {name} (id int)"))
            create_publication(conn, name, table=name)
    for name in (abandoned, live):
        with engine.begin() as conn:
            create_slot(conn, name)
    holder = engine.connect()
    try:
        # A live check holds its slot's advisory lock for as long as it runs.
        holder.execute(
            sa.text("SELECT pg_advisory_lock(hashtext(:kind), hashtext(:name))"),
            {"kind": LOCK_CLASS, "name": live},
        )
        report = verify(logical_server.url, mode="quick", only=["wal-at-least-once"])
        [result] = report.results
        assert result.status == "pass", result
        assert f"dropped 1 abandoned verify slot(s): {abandoned}" in result.detail
        left = leftovers(logical_server.url)
        assert left["slots"] == [live] and left["publications"] == [live], left
    finally:
        holder.close()
        with engine.begin() as conn:
            for name in (abandoned, live):
                drop_slot(conn, name)
                drop_publication(conn, name)
                conn.execute(sa.text(f"DROP TABLE IF EXISTS {name}"))
        engine.dispose()
    assert leftovers(logical_server.url) == NOTHING_LEFT
