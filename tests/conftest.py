"""Shared fixtures: database URLs per dialect, unique tables, CI strictness.

SQLite always runs. PostgreSQL and MariaDB/MySQL run against the URLs in
``OUTBOX_TEST_POSTGRESQL_URL`` / ``OUTBOX_TEST_MYSQL_URL`` (defaults: the
servers on loopback); SQL Server only where ``OUTBOX_TEST_MSSQL_URL`` is set.
``OUTBOX_TEST_BACKENDS`` limits the run to some of them.
With ``CI=true`` an unreachable PostgreSQL, MariaDB or RabbitMQ fails the
test instead of skipping it.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from outbox_core import Outbox
from outbox_core.dialects.base import dialect_families, get_dialect
from outbox_core.dialects.base.provision import provision_for
from outbox_core.schema import OutboxTables
from tests.contract.broker_fixtures import RabbitState, require_rabbitmq

#: Every registered database family: a new dialect package runs every suite with
#: no change here (its provisioning is the ``provision`` module beside its dialect).
ALL_BACKENDS = dialect_families()
REQUIRED_IN_CI = {b for b in ALL_BACKENDS if provision_for(b).required_in_ci} | {"rabbitmq"}
#: ``OUTBOX_TEST_BACKENDS=postgresql,sqlite`` runs the database suites on those only
#: (the compatibility matrix runs one database at a time).
BACKENDS = [
    b.strip()
    for b in os.environ.get("OUTBOX_TEST_BACKENDS", ",".join(ALL_BACKENDS)).split(",")
    if b.strip()
]

_reachable: dict[str, str | None] = {}

#: Tests that measure stalls, gaps and takeover times: under pytest-xdist they
#: run alone (another test's load on this 2-core machine would be measured
#: as their stall); the rest run side by side. A test elsewhere opts in with
#: ``@pytest.mark.alone``; one of these modules that times nothing (long runs
#: asserting loss, order and duplicates) opts out with ``@pytest.mark.shared``.
ALONE = (
    "tests/faults/",
    "tests/chaos/",
    "tests/contract/test_liveness.py",
    "tests/contract/test_end_to_end.py",
    "tests/contract/test_relay_nats_redis.py",
    "tests/contract/test_kafka_relay.py",
    "tests/contract/test_partitions.py",
    "tests/contract/test_verify.py",
    "tests/contract/test_wal_stream.py",
    "tests/unit/test_packaging.py",
)


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def unavailable(service: str, reason: str) -> None:
    """Fail in CI for required services, skip elsewhere."""
    if in_ci() and service in REQUIRED_IN_CI:
        pytest.fail(f"{service} is required in CI but unavailable: {reason}")
    pytest.skip(f"{service} unavailable: {reason}")


#: Drivers that build from source, so not in the dev extra that the README's first
#: command installs (a new user has neither their headers nor a compiler step):
#: mysqlclient needs the MariaDB/MySQL client headers and pkg-config. Their tests
#: carry the ``optional_driver`` mark and skip, saying why, where the driver is
#: missing; ``.ci/run`` installs the drivers after the README's commands and runs
#: ``-m optional_driver`` with OUTBOX_TEST_OPTIONAL_DRIVERS=1, where a missing one fails.
OPTIONAL_DRIVERS = {"mysqlclient": "MySQLdb"}


def require_optional_driver(driver: str) -> None:
    """Skip (or, with OUTBOX_TEST_OPTIONAL_DRIVERS=1, fail) when ``driver`` is missing."""
    try:
        importlib.import_module(OPTIONAL_DRIVERS[driver])
    except ImportError as exc:
        if os.environ.get("OUTBOX_TEST_OPTIONAL_DRIVERS") == "1":
            pytest.fail(f"{driver} must be installed in this run: {exc}")
        pytest.skip(
            f"{driver} is not installed: it builds from source (libmariadb-dev and "
            f"pkg-config, then pip install -e '.[{driver}]'); .ci/run installs it after "
            "the README's commands and runs these tests (-m optional_driver)"
        )


#: Programs from Debian's packages that ``.ci/run`` installs after the README's
#: commands (a new user's machine has neither): headless Chromium for the
#: dashboard's browser tests, promtool (package ``prometheus``) for the alert
#: rules. Their tests carry the ``system_tool`` mark and skip, saying why, where
#: the program is missing; ``.ci/run`` runs ``-m system_tool`` with
#: OUTBOX_TEST_SYSTEM_TOOLS=1, where a missing one fails.
SYSTEM_TOOLS = {"chromium": "chromium", "promtool": "prometheus"}


def require_system_tool(program: str) -> str:
    """The path of ``program``; skip (or, with OUTBOX_TEST_SYSTEM_TOOLS=1, fail) when missing."""
    found = shutil.which(program)
    if found:
        return found
    package = SYSTEM_TOOLS[program]
    if os.environ.get("OUTBOX_TEST_SYSTEM_TOOLS") == "1":
        pytest.fail(f"{program} must be installed in this run (apt-get install {package})")
    pytest.skip(
        f"{program} is not installed: apt-get install {package}; .ci/run installs it after "
        "the README's commands and runs these tests (-m system_tool)"
    )


def server_url(backend: str, workdir: Path | None = None) -> str | None:
    return provision_for(backend).test_url(workdir or Path(tempfile.mkdtemp()))


def _probe(url: str) -> str | None:
    """None when the server answers, else the reason."""
    if url in _reachable:
        return _reachable[url]
    dialect = get_dialect(sa.make_url(url).get_backend_name())(OutboxTables.create())
    args = dialect.session.connect_timeout_args(3)
    try:
        engine = sa.create_engine(url, connect_args=args)
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
        engine.dispose()
        reason = None
    except Exception as exc:
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    _reachable[url] = reason
    return reason


def async_url(backend: str, db_url: str) -> str:
    """``db_url`` with the async driver the test dependencies have; skip where there is none."""
    pytest.importorskip("greenlet")
    async_urls = {
        "sqlite": db_url.replace("sqlite://", "sqlite+aiosqlite://"),
        "postgresql": db_url.replace("+psycopg", "+psycopg_async"),
    }
    if backend not in async_urls:
        pytest.skip(f"no async driver for {backend} in the test dependencies")
    return async_urls[backend]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def reachable_url(backend: str, tmp_path: Path) -> str:
    """A reachable URL for ``backend`` (skip or fail as the rules above say)."""
    if backend not in BACKENDS:
        pytest.skip(f"{backend} not in OUTBOX_TEST_BACKENDS")
    url = server_url(backend, tmp_path)
    if url is not None and not provision_for(backend).needs_server:
        return url  # a file: nothing to reach
    if url is None:
        pytest.skip(f"{backend}: set OUTBOX_TEST_{backend.upper()}_URL to run")
    reason = _probe(url)
    if reason is not None:
        unavailable(backend, reason)
    return url


@pytest.fixture
def db_url(backend: str, tmp_path: Path) -> str:
    """A reachable URL for ``backend`` (skip or fail as the rules above say)."""
    return reachable_url(backend, tmp_path)


@pytest.fixture
def table_name() -> str:
    return f"obx_{uuid.uuid4().hex[:10]}"


@pytest.fixture
def outbox(db_url: str, table_name: str) -> Iterator[Outbox]:
    """An installed outbox on its own table, dropped afterwards."""
    ob = Outbox(db_url, table=table_name)
    ob.install()
    try:
        yield ob
    finally:
        ob.tables.metadata.drop_all(ob.engine)
        ob.dispose()


@pytest.fixture
def rabbit() -> Iterator[RabbitState]:
    """A RabbitMQ exchange and queue of the test's own (fails under CI=true when down)."""
    state = RabbitState(require_rabbitmq())
    yield state
    state.cleanup()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = config.rootpath
    for item in items:
        where = item.path.relative_to(root).as_posix() if item.path.is_relative_to(root) else ""
        if where.startswith(ALONE) and not item.get_closest_marker("shared"):
            item.add_marker(pytest.mark.alone)
        callspec = getattr(item, "callspec", None)
        if callspec is not None and set(OPTIONAL_DRIVERS) & {
            value for value in callspec.params.values() if isinstance(value, str)
        }:
            item.add_marker(pytest.mark.optional_driver)


#: Shared modules with tests of a minute or more: started first, so that none of them
#: is still running when the ``alone`` tests begin (each would wait for it).
LONG_SHARED = (
    "tests/django/",
    "tests/contract/test_wal_relay.py",
    "tests/contract/test_wal_resume.py",
    "tests/contract/test_binlog.py",
    "tests/property/test_guarantees.py",
    "tests/contract/test_migrate.py",
    "tests/contract/test_wal_versions.py",
)


def run_order(item: pytest.Item) -> int:
    """The long shared tests first, then the other shared ones, then the ``alone`` ones.

    Under pytest-xdist an ``alone`` test waits until the tests running on the
    other workers end, and holds back theirs: spread among the others, each
    one idles two workers for the rest of a test they started (up to a Django
    suite's two minutes). Last, they follow one another once the shared tests
    are done, and the shared tests before them fill every worker. The sort is
    stable: pytest's grouping of a module's tests by fixture stays within
    each part.
    """
    if item.get_closest_marker("alone"):
        return 2
    long = item.nodeid.startswith(LONG_SHARED) or item.get_closest_marker("shared")
    return 0 if long else 1


class RunOrder:
    """Sorts the collected tests by :func:`run_order`, after every other plugin (the
    marks, the deselection by ``-m`` and pytest's grouping by fixture come first)."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        items.sort(key=run_order)


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(RunOrder(), "outbox-run-order")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, None, None]:
    """Under pytest-xdist, a test marked ``alone`` waits for the other workers' tests and
    holds theirs back until it is done (setup and teardown included)."""
    # An xdist worker has workerinput; a pytest a test starts (the Django
    # suites) inherits the worker's environment but is not one, and must not
    # queue behind the test that started it.
    worker = getattr(item.config, "workerinput", None)
    if worker is None:  # one process: every test runs alone anyway
        yield
        return
    run = str(worker["testrunuid"])
    asked = time.time()
    with _turn(
        Path(tempfile.gettempdir()) / f"outbox-pytest-{run}",
        alone=bool(item.get_closest_marker("alone")),
    ):
        began = time.time()
        yield
    timeline = os.environ.get("OUTBOX_TEST_TIMELINE")
    if timeline:  # where CI's time goes: worker, test, asked, began, ended
        with open(timeline, "a") as out:
            out.write(
                f"{worker['workerid']}\t{item.nodeid}\t{asked:.2f}\t{began:.2f}\t{time.time():.2f}\n"
            )


@contextlib.contextmanager
def _turn(base: Path, *, alone: bool) -> Iterator[None]:
    """A readers-writer lock across the workers' processes: shared for most tests,
    exclusive for ``alone`` ones. Everyone passes a turnstile first, which a waiting
    exclusive holder keeps, so a stream of shared tests cannot starve it."""
    with open(f"{base}.turn", "a") as turn, open(f"{base}.main", "a") as main:
        fcntl.flock(turn, fcntl.LOCK_EX)
        try:
            fcntl.flock(main, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turn, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(main, fcntl.LOCK_UN)
