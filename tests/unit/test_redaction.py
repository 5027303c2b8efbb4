"""Passwords masked whatever the URL's shape, in URLs and in free text."""

from __future__ import annotations

import json
import logging
import string
from urllib.parse import quote, quote_plus

import pytest
import sqlalchemy as sa
from hypothesis import given, settings
from hypothesis import strategies as st

from outbox_core.brokers.base import create_broker
from outbox_core.cli.logs import JsonFormatter, RedactingFilter, setup_logging
from outbox_core.errors import ConfigurationError
from outbox_core.redaction import mask_url, redact
from outbox_core.urls import sync_url

SHAPES = [
    # well formed: everything but the password kept
    ("amqp://app:S3cr3t@rabbit:5672/%2F", "amqp://app:***@rabbit:5672/%2F"),
    ("postgresql+psycopg://app:S3cr3t@db:5432/app", "postgresql+psycopg://app:***@db:5432/app"),
    ("amqp://:S3cr3t@rabbit/", "amqp://:***@rabbit/"),
    # a typo in the scheme separator
    ("amqp//app:S3cr3t@rabbit:5672/%2F", "amqp//app:***@rabbit:5672/%2F"),
    ("amqp:/app:S3cr3t@rabbit/", "amqp:/app:***@rabbit/"),
    ("amqp:app:S3cr3t@rabbit/", "amqp:***@rabbit/"),
    (
        "postgresql+psycopg//postgres:S3cr3t@127.0.0.1/test",
        "postgresql+psycopg//postgres:***@127.0.0.1/test",
    ),
    # no scheme at all
    ("app:S3cr3t@rabbit:5672", "app:***@rabbit:5672"),
    ("--db=postgres:S3cr3t@db/app", "--db=postgres:***@db/app"),
    # passwords holding '@', ':' or '/', percent-encoded ones
    ("amqp://app:S3c@r:3t@rabbit/vh", "amqp://app:***@rabbit/vh"),
    ("amqp://app:S3c/r3t@rabbit/vh", "amqp://app:***@rabbit/vh"),
    ("amqp://app:S3cr3t%40x%3Ay@rabbit/", "amqp://app:***@rabbit/"),
    ("http://u:S3cr3t@[::1]:8080/hook", "http://u:***@[::1]:8080/hook"),
    # a whole URL percent-encoded inside another one
    (
        "https://hooks/x?to=amqp%3A%2F%2Fapp%3AS3cr3t%40rabbit%2F",
        "https://hooks/x?to=amqp%3A%2F%2Fapp%3A***%40rabbit%2F",
    ),
    # nothing to mask
    ("sqlite:///x.db", "sqlite:///x.db"),
    ("amqp://guest@rabbit/", "amqp://guest@rabbit/"),
    ("mail ops@example.com at 12:30:00", "mail ops@example.com at 12:30:00"),
]


@pytest.mark.parametrize(("given", "masked"), SHAPES)
def test_mask_url_masks_every_shape_of_userinfo(given: str, masked: str) -> None:
    assert mask_url(given) == masked
    assert redact(given) == masked
    assert "S3cr3t" not in mask_url(given)


@pytest.mark.parametrize(
    "text",
    [
        "relaying postgresql+psycopg//postgres:S3cr3t@db/x -> amqp//app:S3cr3t@rabbit:5672/%2F",
        "error: could not parse 'amqp//app:S3cr3t@rabbit' (bad)",
        '{"url": "amqp//app:S3cr3t@rabbit/", "other": "x"}',
        "two: a://u:S3cr3t@h and b//v:S3cr3t@k, c:/w:S3cr3t@m",
        "DSN(app:S3cr3t@rabbit) failed",
    ],
)
def test_redact_masks_userinfo_in_free_text(text: str) -> None:
    assert "S3cr3t" not in redact(text)
    assert "***@" in redact(text)


def test_redact_is_idempotent() -> None:
    once = redact("amqp//app:S3cr3t@rabbit/ and x:y@z")
    assert redact(once) == once


def test_json_log_lines_mask_messages_and_extra_fields() -> None:
    record = logging.LogRecord(
        "outbox.relay", logging.INFO, __file__, 1, "relaying %s", ("amqp//app:S3cr3t@r/",), None
    )
    record.broker = "amqp//app:S3cr3t@r/"
    assert RedactingFilter().filter(record)
    line = JsonFormatter().format(record)
    assert "S3cr3t" not in line
    assert json.loads(line)["broker"] == "amqp//app:***@r/"


@pytest.mark.parametrize(
    "url", ["amqp//app:S3cr3t@rabbit:5672/%2F", "amqp:/app:S3cr3t@rabbit/", "app:S3cr3t@rabbit"]
)
def test_a_broker_url_without_scheme_separator_is_its_own_error(url: str) -> None:
    with pytest.raises(ConfigurationError, match="'://' is missing after the scheme") as info:
        create_broker(url)
    assert "S3cr3t" not in str(info.value) and "***" in str(info.value)


@pytest.mark.parametrize(
    "url", ["postgresql+psycopg//postgres:S3cr3t@127.0.0.1/test", "mysql+pymysql:/root:S3cr3t@h/db"]
)
def test_a_database_url_without_scheme_separator_is_its_own_error(url: str) -> None:
    with pytest.raises(ConfigurationError, match="'://' is missing after the scheme") as info:
        sync_url(url)
    assert "S3cr3t" not in str(info.value) and "***" in str(info.value)


def test_text_log_lines_mask_tracebacks_too(capsys: pytest.CaptureFixture[str]) -> None:
    root, outbox = logging.getLogger(), logging.getLogger("outbox")
    saved = (root.handlers[:], root.level, outbox.level)
    setup_logging(verbose=0, json_logs=False)
    try:
        raise ConnectionError("cannot reach amqp//app:S3cr3t@rabbit:5672/%2F")
    except ConnectionError:
        logging.getLogger("outbox.relay").exception("publishing failed")
    finally:
        root.handlers[:], _, _ = saved
        root.setLevel(saved[1])
        outbox.setLevel(saved[2])
    err = capsys.readouterr().err
    assert "publishing failed" in err and "ConnectionError" in err
    assert "S3cr3t" not in err and "amqp//app:***@rabbit" in err


# -- every shape of URL, generated ----------------------------------------------------------

MARK = "Qz7Secret"
_SCHEMES = ["postgresql+psycopg", "mysql+pymysql", "mssql+pyodbc", "amqp", "amqps", "redis"]
_SCHEMES += ["rediss", "nats", "kafka", "https", "sqlite"]
_PASSWORD_CHARS = string.ascii_letters + string.digits + " @:/%?&#=+!$'()*,;[]~._-\\"


@st.composite
def secret(draw: st.DrawFn) -> str:
    """A password with the marker somewhere in it, of any characters."""
    before = draw(st.text(_PASSWORD_CHARS, max_size=8))
    after = draw(st.text(_PASSWORD_CHARS, max_size=8))
    return before + MARK + after


@st.composite
def url_with_secrets(draw: st.DrawFn) -> str:
    scheme = draw(st.sampled_from(_SCHEMES))
    sep = draw(st.sampled_from(["://", "://", "//", ":/"]))
    user = draw(st.text(string.ascii_letters + string.digits + "._-", min_size=0, max_size=6))
    password = draw(secret())
    form = draw(st.sampled_from(["encoded", "encoded_plus", "raw", "sqlalchemy"]))
    host = draw(st.sampled_from(["db", "db.example.com", "10.0.0.5", "[::1]"]))
    port = draw(st.sampled_from(["", ":5432", ":6379"]))
    query_name = draw(st.sampled_from(["password", "sslpassword", "PASSWORD", "api_key", "token"]))
    query_value = quote(draw(secret()), safe="")
    query = draw(
        st.sampled_from(
            ["", f"?{query_name}={query_value}", f"?a=1&{query_name}=" + query_value + "&b=2"]
        )
    )
    if form == "sqlalchemy":
        rendered = sa.URL.create(
            "postgresql+psycopg",
            username=user or "u",
            password=password,
            host="db",
            database="app",
        ).render_as_string(hide_password=False)
        return rendered + query
    if form == "raw":
        # Typed by hand: no white space (a space ends a URL in any text), not led by '/'.
        password = password.replace(" ", "").replace("\\", "").lstrip("/") or MARK
    else:
        password = quote(password, safe="") if form == "encoded" else quote_plus(password)
    return f"{scheme}{sep}{user}:{password}@{host}{port}/app{query}"


@settings(max_examples=400, deadline=None)
@given(
    url=url_with_secrets(),
    where=st.sampled_from(
        ["{}", "error: cannot reach {}: refused", "relaying {} -> amqp://g:{}@x/"]
    ),
)
def test_no_password_survives_masking_in_any_url_shape(url: str, where: str) -> None:
    text = where.format(url, url)
    for masked in (mask_url(url), redact(text), redact(quote(text, safe=""))):
        assert MARK not in masked, masked


@settings(max_examples=200, deadline=None)
@given(password=secret(), query_secret=secret())
def test_a_sqlalchemy_url_is_masked_by_its_parts(password: str, query_secret: str) -> None:
    url = sa.URL.create(
        "postgresql+psycopg",
        username="app",
        password=password,
        host="db",
        database="app",
        query={"sslpassword": query_secret, "sslmode": "require"},
    )
    masked = mask_url(url)
    assert MARK not in masked
    assert "sslmode=require" in masked and "@db/app" in masked
