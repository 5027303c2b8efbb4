"""A relay that dies (``os._exit``) right after the broker confirmed a batch, before marking it.

Run as ``python -m tests.contract.dying_relay DB_URL TABLE BROKER_URL [KEY=VALUE...]``:
one ordered relay cycle through the real broker, whose ``publish`` returns
to nobody. The rows stay claimed until their lease (2 s) runs out, as after
a SIGKILL between publishing and marking; the next relay publishes them again.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from outbox_core import Outbox
from outbox_core.brokers.base import Broker, create_broker
from outbox_core.message import Event, Outcome

#: The exit status a test can tell from a crash elsewhere.
DIED = 9


class DiesAfterPublishing(Broker):
    """The real broker, and death once it has confirmed the first batch."""

    def __init__(self, inner: Broker) -> None:
        self.inner = inner
        self.keeps_batch_order = inner.keeps_batch_order  # type: ignore[misc]

    def publish(self, events: Sequence[Event]) -> Sequence[Outcome]:
        outcomes = self.inner.publish(events)
        if all(o.is_ok for o in outcomes):
            os._exit(DIED)  # no mark, no cleanup: as SIGKILL would leave it
        return outcomes

    def probe(self) -> str | None:
        return self.inner.probe()


def main(argv: list[str]) -> None:
    db_url, table, broker_url, *options = argv
    broker = create_broker(broker_url, **dict(o.split("=", 1) for o in options))
    outbox = Outbox(db_url, table=table)
    relay = outbox.relay(DiesAfterPublishing(broker), ordered=True, lease=2, batch_size=100)
    relay.run_once()
    raise SystemExit("the relay published nothing")


if __name__ == "__main__":
    main(sys.argv[1:])
