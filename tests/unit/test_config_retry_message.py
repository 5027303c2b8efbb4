"""Settings, retry maths, URL masking, event validation."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest

from outbox_core.cli import RedactingFilter
from outbox_core.config import load_settings
from outbox_core.errors import ConfigurationError, EventError, PayloadError
from outbox_core.fields import parse_duration
from outbox_core.message import Outcome, build_new_event
from outbox_core.redaction import mask_url, redact
from outbox_core.retry import RetryPolicy


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("30", 30),
        (1.5, 1.5),
        ("500ms", 0.5),
        ("30s", 30),
        ("5m", 300),
        ("2h", 7200),
        ("2d", 172800),
    ],
)
def test_parse_duration(text: str | float, seconds: float) -> None:
    assert parse_duration(text) == seconds


def test_bad_duration_is_named() -> None:
    with pytest.raises(ConfigurationError, match="lease"):
        parse_duration("soon", "lease")


def test_settings_precedence_arguments_env_file(tmp_path: Path) -> None:
    config = tmp_path / "outbox.toml"
    config.write_text(
        '[outbox]\ndatabase_url = "sqlite:///file.db"\n'
        'batch-size = 50\nlease = "1m"\nordered = true\n'
    )
    env = {"OUTBOX_BATCH_SIZE": "70", "OUTBOX_BROKER_URL": "memory://env"}
    s = load_settings({"lease": "10s"}, config_file=config, env=env)
    assert s.database_url == "sqlite:///file.db"
    assert s.batch_size == 70  # env beats file
    assert s.lease == 10  # argument beats file
    assert s.ordered is True
    assert s.broker_url == "memory://env"


def test_unknown_setting_and_bad_values_are_named(tmp_path: Path) -> None:
    config = tmp_path / "outbox.toml"
    config.write_text("batch_sise = 5\n")
    with pytest.raises(ConfigurationError, match="batch_sise"):
        load_settings(config_file=config, env={})
    with pytest.raises(ConfigurationError, match="batch_size"):
        load_settings({"batch_size": "many"}, env={})
    with pytest.raises(ConfigurationError, match="ordered"):
        load_settings({"ordered": "perhaps"}, env={})


def test_mask_url_hides_passwords() -> None:
    assert mask_url("postgresql+psycopg://app:s3cret@db:5432/app") == (
        "postgresql+psycopg://app:***@db:5432/app"
    )
    assert mask_url("amqp://guest:guest@localhost/") == "amqp://guest:***@localhost/"
    assert mask_url("sqlite:///x.db") == "sqlite:///x.db"
    assert "s3cret" not in redact("could not connect to mysql+pymysql://root:s3cret@h/db: refused")


def test_log_records_never_carry_a_password(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("outbox.test")
    handler_filter = RedactingFilter()
    record = logger.makeRecord(
        "outbox.test", logging.ERROR, __file__, 1, "failed on %s", ("amqp://u:pw123@h/",), None
    )
    handler_filter.filter(record)
    assert "pw123" not in record.getMessage()


def test_exponential_backoff_with_jitter_is_bounded() -> None:
    policy = RetryPolicy(base=1, cap=60, jitter=0.5)
    rng = random.Random(1)
    for attempt, raw in [(1, 1), (2, 2), (3, 4), (7, 60), (50, 60), (10_000, 60)]:
        for _ in range(50):
            delay = policy.backoff(attempt, rng)
            assert raw * 0.5 <= delay <= raw


def test_fixed_backoff() -> None:
    policy = RetryPolicy(base=5, jitter=0, kind="fixed")
    assert policy.backoff(1) == policy.backoff(9) == 5


def test_next_try_dead_after_max_attempts_or_reject() -> None:
    policy = RetryPolicy(max_attempts=3, base=1, jitter=0)
    assert policy.next_try(1, Outcome.retry("x")) == 1
    assert policy.next_try(2, Outcome.retry("x")) == 2
    assert policy.next_try(3, Outcome.retry("x")) is None
    assert policy.next_try(1, Outcome.reject("x")) is None
    assert policy.next_try(1, Outcome.retry("429", retry_after=30)) == 30


def test_event_validation_messages() -> None:
    with pytest.raises(PayloadError, match=r"payload\['a'\]\[0\].*set"):
        build_new_event("t", {"a": [{1, 2}]})
    with pytest.raises(PayloadError, match="NaN"):
        build_new_event("t", {"x": float("nan")})
    with pytest.raises(PayloadError, match="circular"):
        loop: list[object] = []
        loop.append(loop)
        build_new_event("t", {"loop": loop})
    with pytest.raises(EventError, match="key"):
        build_new_event("t", {}, key="")
    event = build_new_event("t", {"ok": [1, "a", None, True, 1.5]}, key="k", delay=2)
    assert event.delay_seconds == 2
    assert len(event.event_id) == 36
