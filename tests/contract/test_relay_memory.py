"""A relay moving large payloads holds a bounded number of bytes, whatever its batch size.

Thirty payloads of 8 MiB are relayed with the default settings by a relay in
a process of its own (``bench/memory.py``'s ``--payload-bytes`` run), so the
resident size measured is the relay's: its peak (the kernel's high-water
mark) stays under 400 MiB, where a claim bounded only by ``batch_size`` (100)
holds all thirty at once (about 560 MiB on PostgreSQL), and no batch holds
more than ``batch_bytes`` plus one event.
"""

from __future__ import annotations

import pytest

from bench.memory import MIB, measure_large
from outbox_core.config import Settings

EVENTS = 30
PAYLOAD = 8 * MIB
#: The bound the relay must keep; measured about 140 MiB on PostgreSQL.
PEAK_MIB = 400


@pytest.mark.alone  # 240 MiB written and read: a measure of its own
def test_a_relay_moving_large_payloads_stays_under_its_memory_bound(db_url: str) -> None:
    run = measure_large(db_url, EVENTS, PAYLOAD)
    assert run.batch_bytes == Settings.batch_bytes
    assert run.batch_size == Settings.batch_size
    assert run.peak_mib < PEAK_MIB, run
    # JSON as published against the stored size the budget counts: a little slack.
    assert run.largest_batch_bytes <= run.batch_bytes + PAYLOAD + PAYLOAD // 100, run
    assert run.largest_batch < EVENTS, run
