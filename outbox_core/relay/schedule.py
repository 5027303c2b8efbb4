"""When periodic work is due, and the side tasks of a running relay on threads of their own.

:class:`Every` is a periodic job's schedule (reap, cleanup, progress
reports); :class:`Tasks` starts a relay's :class:`Task` objects (maintenance,
heartbeats, LISTEN) beside its loop and joins them when the loop ends. Each
task is an object next to the state it touches, with one loop that returns
once the relay is asked to stop.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass
class Every:
    """A periodic job's schedule (monotonic clock); an interval of 0 never runs it."""

    interval: float
    next_at: float = 0.0

    def due(self, now: float) -> bool:
        """True (and the next run scheduled) when the job is due at ``now``."""
        if self.interval <= 0 or now < self.next_at:
            return False
        self.next_at = now + self.interval
        return True


class Task(Protocol):
    """A side task of a running relay: one loop on a thread of its own."""

    #: The thread's name (``outbox-maintain``...), as seen in thread dumps.
    name: str
    #: How long the relay waits for the loop to return once stopped, in seconds.
    join_timeout: float

    def run(self) -> None:
        """Loop until the relay is asked to stop; log errors, never raise."""


class Tasks:
    """The side tasks of one ``run()``: started before the loop, joined after it."""

    def __init__(self, tasks: Sequence[Task]) -> None:
        self.tasks = list(tasks)
        self._threads: list[tuple[threading.Thread, float]] = []

    def start(self) -> None:
        """Start each task on a daemon thread (a stuck one never keeps the process alive)."""
        for task in self.tasks:
            thread = threading.Thread(target=task.run, name=task.name, daemon=True)
            thread.start()
            self._threads.append((thread, task.join_timeout))

    def join(self) -> None:
        """Wait for the tasks to return (each at most its ``join_timeout``)."""
        for thread, timeout in self._threads:
            thread.join(timeout)
        self._threads.clear()
