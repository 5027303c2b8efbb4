"""A ``python://outbox_core.verify.sink:publish`` broker for relay child processes.

``outbox verify``'s SIGKILL run (and the fault suites) start real ``outbox
relay`` processes with this broker. It appends ``<event id> <pid> <unix
time>`` per delivered event to the file named by ``OUTBOX_VERIFY_SINK``: one
``write`` per batch on an ``O_APPEND`` file, so relays in several processes
never interleave a line, and the file's order is the order of publishing. A
line written before a SIGKILL stays written (it is in the kernel, not in a
Python buffer). With ``OUTBOX_VERIFY_PUBLISH_SECONDS`` each batch takes that
long first: a slow broker.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from outbox_core.message import Event

_SLOW = float(os.environ.get("OUTBOX_VERIFY_PUBLISH_SECONDS", "0") or 0)


def publish(events: Sequence[Event]) -> None:
    """Deliver ``events`` to the sink file (all accepted)."""
    if _SLOW:
        time.sleep(_SLOW)
    now = time.time()
    lines = "".join(f"{e.event_id} {os.getpid()} {now:.3f}\n" for e in events)
    fd = os.open(os.environ["OUTBOX_VERIFY_SINK"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, lines.encode())
    finally:
        os.close(fd)


def read(path: str) -> list[tuple[str, int, float]]:
    """What the sink recorded: ``(event id, relay pid, time)`` in delivery order."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3:
                out.append((parts[0], int(parts[1]), float(parts[2])))
    return out
