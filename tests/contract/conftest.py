"""Fixtures of the contract suites: a RabbitMQ exchange of the test's own."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.contract.broker_fixtures import RabbitState, require_rabbitmq


@pytest.fixture
def rabbit() -> Iterator[RabbitState]:
    state = RabbitState(require_rabbitmq())
    yield state
    state.cleanup()
