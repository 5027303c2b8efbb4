"""``outbox`` CLI with fault points: the relay freezes itself inside a transaction.

Run as ``python -m tests.faults.frozen_relay relay ...`` (the same arguments
as ``outbox relay``). The dialect's ``claim``, ``mark_sent``, ``cleanup`` and
``reap``, and its key walk's ``claim_runs``, are wrapped: each runs inside a transaction of its
own, and when the file ``freeze-<point>`` exists in ``OUTBOX_FAULT_DIR``
(``point`` is ``claim``, ``settle``, ``cleanup`` or ``reap``) and the call
touched rows, the file is removed and the process stops itself with SIGSTOP
*before the transaction commits*: a GC or VM pause, or a partition that keeps
the TCP connection open, at the worst moment. The test resumes it with SIGCONT.
"""

from __future__ import annotations

import functools
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from outbox_core.dialects.base import REGISTRY, get_dialect

#: Dialect method -> fault point.
POINTS = {
    "claim": "claim",
    "mark_sent": "settle",
    "cleanup": "cleanup",
    "reap": "reap",
}
#: Methods of the dialect's key walk (its ``keys`` part) -> fault point.
KEY_POINTS = {"claim_runs": "claim"}


def _freeze_if_asked(point: str) -> None:
    trigger = Path(os.environ["OUTBOX_FAULT_DIR"]) / f"freeze-{point}"
    try:
        trigger.unlink()
    except FileNotFoundError:
        return
    os.kill(os.getpid(), signal.SIGSTOP)


def _wrap(method: Callable[..., Any], point: str) -> Callable[..., Any]:
    @functools.wraps(method)
    def wrapper(self: Any, conn: Any, *args: Any, **kwargs: Any) -> Any:
        dialect = getattr(self, "dialect", self)  # a part reaches its dialect
        with dialect.transaction(conn):
            result = method(self, conn, *args, **kwargs)
            if result:  # it holds row locks now
                _freeze_if_asked(point)
        return result

    return wrapper


def _wrap_all(cls: type, points: dict[str, str]) -> None:
    for method, point in points.items():
        if not getattr(getattr(cls, method), "_fault_point", False):
            wrapped = _wrap(getattr(cls, method), point)
            wrapped._fault_point = True  # type: ignore[attr-defined]
            setattr(cls, method, wrapped)


def install() -> None:
    """Wrap the fault points of every registered dialect class and of its key walk."""
    for name in set(REGISTRY):
        try:
            cls = get_dialect(name)
        except ImportError:
            continue
        _wrap_all(cls, POINTS)
        _wrap_all(cls.parts.keys, KEY_POINTS)


if __name__ == "__main__":
    install()
    from outbox_core.cli import main

    main(prog_name="outbox")
