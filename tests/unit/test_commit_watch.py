"""The commit watch: wakes after the transaction is over, never before; gives up on long ones."""

from __future__ import annotations

import threading
import time

from outbox_core.ports import CommitWatch


class Conn:
    def __init__(self) -> None:
        self.in_transaction = True


def _ended(conn: Conn) -> bool:
    return not conn.in_transaction


def test_the_callback_runs_once_the_transaction_is_over_not_before() -> None:
    watch = CommitWatch(interval=0.002)
    conn, called = Conn(), threading.Event()
    watch.watch(conn, _ended, called.set)
    assert not called.wait(0.1)
    conn.in_transaction = False
    assert called.wait(1)
    assert _wait_for(lambda: watch.pending() == 0)


def test_a_later_callback_of_the_same_connection_and_owner_replaces_the_earlier() -> None:
    watch = CommitWatch(interval=0.002)
    conn, owner, calls = Conn(), object(), []
    watch.watch(conn, _ended, lambda: calls.append("first"), owner=owner)
    watch.watch(conn, _ended, lambda: calls.append("second"), owner=owner)
    watch.watch(conn, _ended, lambda: calls.append("other owner"), owner=object())
    conn.in_transaction = False
    assert _wait_for(lambda: len(calls) == 2)
    time.sleep(0.05)
    assert sorted(calls) == ["other owner", "second"]


def test_a_transaction_open_too_long_is_dropped_without_a_call() -> None:
    watch = CommitWatch(interval=0.002, give_up=0.05)
    conn, called = Conn(), threading.Event()
    watch.watch(conn, _ended, called.set)
    assert _wait_for(lambda: watch.pending() == 0)
    conn.in_transaction = False
    assert not called.wait(0.1)


def test_a_failing_flag_read_counts_as_over_and_a_failing_callback_is_logged() -> None:
    watch = CommitWatch(interval=0.002)
    called = threading.Event()

    def broken(conn: Conn) -> bool:
        raise RuntimeError("closed")

    def boom() -> None:
        raise RuntimeError("callback failed")

    watch.watch(Conn(), broken, boom, owner=1)
    watch.watch(Conn(), broken, called.set, owner=2)
    assert called.wait(1)  # the thread survived the failing callback


def _wait_for(predicate: object, timeout: float = 2) -> bool:
    assert callable(predicate)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return False
