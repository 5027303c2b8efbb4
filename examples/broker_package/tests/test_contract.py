"""The toolkit's broker contract, run against this package's broker."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from outbox_jsonl import JsonLinesBroker

from outbox_core.brokers.base import create_broker
from outbox_core.message import Event
from outbox_core.testing.broker_contract import *  # noqa: F403  (the contract's tests)
from outbox_core.testing.broker_contract import Harness, make_event


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    """The contract's questions answered for this broker: a file of the test's own."""
    path = tmp_path / "events.jsonl"

    def arrived() -> dict[str, tuple[str, dict[str, Any], Any]]:
        if not path.exists():
            return {}
        records = [json.loads(line) for line in path.read_text().splitlines()]
        return {r["event_id"]: (r["topic"], r["headers"], r["payload"]) for r in records}

    def fail(event: Event, kind: str, retry_after: float | None) -> Event:
        return make_event(event.topic, key=event.key, payload={"amount": float("nan")})

    def down() -> JsonLinesBroker:
        return JsonLinesBroker(str(tmp_path / "missing" / "events.jsonl"))

    h = Harness("jsonl", create_broker(f"jsonl://{path}"), arrived, fail, down, can_retry=False)
    yield h
    h.close()


def test_the_entry_point_serves_the_scheme(tmp_path: Path) -> None:
    """Installed, the package serves jsonl:// through its entry point."""
    assert isinstance(create_broker(f"jsonl://{tmp_path}/x.jsonl"), JsonLinesBroker)
