"""Fixtures the log-tailing test modules share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.conftest import reachable_url
from tests.contract.test_wal_stream import LOGICAL, private_postgres
from tests.faults.private_servers import PrivatePostgres

if TYPE_CHECKING:
    from tests.kafka_mock import Cluster


@pytest.fixture(scope="module")
def logical_server() -> Iterator[PrivatePostgres]:
    """A private PostgreSQL at ``wal_level=logical``, one per test module, removed after."""
    pg = private_postgres(LOGICAL)
    try:
        pg.start()
        yield pg
    finally:
        pg.remove()


@pytest.fixture
def pg_url(tmp_path: Path) -> str:
    """The test PostgreSQL's URL (skipped when not selected; down: fails under CI=true)."""
    return reachable_url("postgresql", tmp_path)


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    """The mock cluster, or the real Kafka at ``OUTBOX_TEST_KAFKA_URL`` (compatibility workflow)."""
    from tests.kafka_mock import kafka_cluster

    made = kafka_cluster()
    yield made
    made.close()
