"""Fixtures the log-tailing test modules share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.contract.test_wal_stream import LOGICAL, private_postgres
from tests.faults.private_servers import PrivatePostgres


@pytest.fixture(scope="module")
def logical_server() -> Iterator[PrivatePostgres]:
    """A private PostgreSQL at ``wal_level=logical``, one per test module, removed after."""
    pg = private_postgres(LOGICAL)
    try:
        pg.start()
        yield pg
    finally:
        pg.remove()
