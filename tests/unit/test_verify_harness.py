"""The verify harness's threads: results in slot order, a thread's error re-raised."""

from __future__ import annotations

import threading

import pytest

from outbox_core.verify.harness import run_concurrently


def test_results_come_back_in_slot_order() -> None:
    start = threading.Barrier(3)

    def square(slot: int) -> int:
        start.wait()  # all three run at once
        return slot * slot

    assert run_concurrently(square, 3) == [0, 1, 4]


def test_an_error_in_one_thread_is_raised_after_all_finished() -> None:
    finished: list[int] = []

    def work(slot: int) -> None:
        if slot == 1:
            raise KeyError("slot 1")
        finished.append(slot)

    with pytest.raises(KeyError, match="slot 1"):
        run_concurrently(work, 3)
    assert sorted(finished) == [0, 2]
