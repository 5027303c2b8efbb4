"""Every command of docs/django.md, run the way it shows them, on the test project."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import tomllib
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from django.db import connections

from outbox_core.contrib.django.models import OutboxEvent
from tests.contract.broker_fixtures import require_rabbitmq
from tests.django.project.orders.models import Customer, Invoice
from tests.django.project.orders.services import place_order
from tests.django.suite.conftest import MANAGE, manage

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "django.md"

pytestmark = pytest.mark.django_db(transaction=True)


def doc_commands() -> list[str]:
    text = DOC.read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


def test_the_doc_shows_exactly_the_commands_these_tests_run() -> None:
    assert doc_commands() == [
        "pip install './outbox-toolkit[django,postgresql,rabbitmq]'",
        "python manage.py migrate",
        "python manage.py outbox doctor",
        "python manage.py outbox relay --broker-option exchange=orders",
        "python manage.py outbox status",
        "python manage.py outbox status --broker",
        "python manage.py outbox replay --topic orders.created",
        "python manage.py consume_orders",
        "python manage.py test orders",
    ]


def test_pip_install_names_extras_that_exist() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    command = doc_commands()[0]
    named = re.search(r"\[(.*?)\]", command)
    assert named is not None
    assert set(named.group(1).split(",")) <= set(extras)
    assert any(dep.startswith("Django") for dep in extras["django"])


def test_migrate_then_doctor_on_a_new_database(fresh_database: str) -> None:
    env = {"OBX_DJANGO_DB_NAME": fresh_database}
    migrate = manage("migrate", env=env)
    assert migrate.returncode == 0, migrate.stderr
    assert "Applying outbox_toolkit.0001_initial... OK" in migrate.stdout
    doctor = manage("outbox", "doctor", env=env)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert "0 error(s), 0 warning(s)" in doctor.stdout
    assert "tables outbox, outbox_inbox exist" in doctor.stdout


def _popen(*args: str) -> subprocess.Popen[str]:
    env = dict(os.environ)
    env["OBX_DJANGO_DB_NAME"] = str(connections["default"].settings_dict["NAME"])
    env["OBX_DJANGO_OTHER_NAME"] = str(connections["other"].settings_dict["NAME"])
    from django.conf import settings

    env["DJANGO_SETTINGS_MODULE"] = settings.SETTINGS_MODULE
    # A process that does not stop is aborted by _stop: faulthandler then
    # prints every thread's stack, which the failure shows.
    env["PYTHONFAULTHANDLER"] = "1"
    return subprocess.Popen(
        [sys.executable, str(MANAGE), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _stop(process: subprocess.Popen[str], seconds: float = 60) -> tuple[int, str]:
    """SIGTERM, then the exit code and output; a process still running after ``seconds`` fails."""
    process.send_signal(signal.SIGTERM)
    try:
        out, err = process.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGABRT)
        out, err = process.communicate(timeout=30)
        output = (out + err)[-8000:]
        pytest.fail(f"{process.args} still running {seconds:g}s after SIGTERM:\n{output}")
    return process.returncode, out + err


def _wait(condition: Any, seconds: float = 30) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return False


def test_relay_and_consumer_end_to_end() -> None:
    """The order's event goes through `outbox relay` to `consume_orders`, billed once."""
    import pika

    url = require_rabbitmq()
    exchange = queue = f"django22.docs.{uuid.uuid4().hex[:8]}"
    # The doc's commands; only the exchange and queue names are this test's own.
    consumer = _popen("consume_orders", "--exchange", exchange, "--queue", queue)
    relay = None
    channel_conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = channel_conn.channel()

        def queue_ready() -> bool:
            nonlocal channel
            try:
                channel.queue_declare(queue, passive=True)
                return True
            except pika.exceptions.ChannelClosedByBroker:
                channel = channel_conn.channel()
                return False

        assert _wait(queue_ready), "consume_orders did not declare its queue"
        customer = Customer.objects.create(name="Ada")
        order = place_order(customer.pk, Decimal("12.50"))
        relay = _popen("outbox", "relay", "--broker-option", f"exchange={exchange}")
        assert _wait(lambda: Invoice.objects.filter(order_id=order.pk).exists())
        invoice = Invoice.objects.get(order_id=order.pk)
        assert invoice.total == Decimal("12.50")
        # Sent: the settle commits after the broker's confirm, maybe after the consumer ran.
        assert _wait(lambda: OutboxEvent.objects.get().state == 2)
    finally:
        code, output = _stop(consumer)
        assert code == 0, output
        if relay is not None:
            code, output = _stop(relay)
            assert code == 0, output
            assert "guest:guest" not in output
        try:
            channel_conn.channel().queue_delete(queue)
            channel_conn.channel().exchange_delete(exchange)
        finally:
            channel_conn.close()


def test_status_and_replay() -> None:
    customer = Customer.objects.create(name="Ada")
    place_order(customer.pk, Decimal("1.00"))
    OutboxEvent.objects.update(state=3, attempts=10, last_error="rejected")
    status = manage("outbox", "status")
    assert status.returncode == 0, status.stderr
    assert re.search(r"dead\s+1", status.stdout), status.stdout
    replay = manage("outbox", "replay", "--topic", "orders.created")
    assert replay.returncode == 0, replay.stderr
    event = OutboxEvent.objects.get()
    assert (event.state, event.attempts) == (0, 0)


def test_status_with_the_broker() -> None:
    """`status --broker` probes the settings' broker (RabbitMQ here): up, exit 0."""
    require_rabbitmq()
    result = manage("outbox", "status", "--broker")
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"broker\b.*\bup\b", result.stdout), result.stdout
    assert "guest:guest" not in result.stdout + result.stderr


def test_manage_py_test_runs_the_docs_tests() -> None:
    # `manage.py test orders` in a project laid out as the doc's; here the app's
    # module is tests.django.project.orders. Own test databases (suffix).
    result = manage(
        "test", "tests.django.project.orders", "--noinput", env={"OBX_DJANGO_TEST_SUFFIX": "_docs"}
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Ran 2 tests" in result.stderr
