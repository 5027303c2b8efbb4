"""``nats://`` and ``redis://`` without their client libraries: one clear error naming the extra."""

from __future__ import annotations

import sys

import pytest

from outbox_core.brokers.base import create_broker
from outbox_core.errors import BrokerError


@pytest.mark.parametrize(
    ("url", "library", "module", "extra"),
    [
        ("nats://127.0.0.1:4222", "nats", "outbox_core.brokers.nats", "nats"),
        ("redis://127.0.0.1:6379/0", "redis", "outbox_core.brokers.redis", "redis"),
        ("rediss://u:s3cret@127.0.0.1:6380/0", "redis", "outbox_core.brokers.redis", "redis"),
    ],
)
def test_missing_client_library_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, url: str, library: str, module: str, extra: str
) -> None:
    monkeypatch.setitem(sys.modules, library, None)  # "import nats" now fails
    monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(BrokerError) as caught:
        create_broker(url)
    message = str(caught.value)
    assert f"pip install 'outbox-toolkit[{extra}]'" in message
    assert "s3cret" not in message
