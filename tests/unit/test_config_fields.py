"""Conversion derived from dataclass field types: Settings and broker options share it."""

from __future__ import annotations

import enum
import ssl
from dataclasses import dataclass
from typing import Any, Literal

import pytest

from outbox_core.brokers.converters import cloudevents_source, optional_count
from outbox_core.config import Settings, load_settings
from outbox_core.errors import ConfigurationError
from outbox_core.fields import checked, convert_fields, field_converters, from_values, setting


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclass(frozen=True)
class Knobs:
    """One field of every type the mechanism converts; no list names any of them."""

    wait: float = 1.0
    strictly: float = setting(1.0, positive=True)
    count: int = 3
    zero_ok: int = setting(0, minimum=0)
    flag: bool = False
    label: str = "x"
    maybe: int | None = None
    mode: Literal["fast", "safe"] = "safe"
    colour: Colour = Colour.RED
    context: ssl.SSLContext | None = None
    custom: tuple[str, ...] = setting((), convert=lambda value, name: tuple(value.split(",")))


def test_each_field_type_is_converted_from_strings() -> None:
    knobs = from_values(
        Knobs,
        {
            "wait": "500ms",
            "strictly": "2m",
            "count": "7",
            "zero_ok": "0",
            "flag": "yes",
            "label": 5,
            "maybe": "4",
            "mode": "FAST",
            "colour": "blue",
            "custom": "a,b",
        },
    )
    assert knobs == Knobs(0.5, 120.0, 7, 0, True, "5", 4, "fast", Colour.BLUE, None, ("a", "b"))
    assert from_values(Knobs, {"colour": Colour.RED}).colour is Colour.RED
    assert from_values(Knobs, {"maybe": None, "context": None}).maybe is None
    context = ssl.create_default_context()
    assert from_values(Knobs, {"context": context}).context is context


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("wait", "soon", "wait: 'soon' is not a duration"),
        ("wait", -1, "wait: must not be negative"),
        ("strictly", "0", "strictly must be positive"),
        ("count", "0", "count: must be at least 1"),
        ("count", "many", "count: expected an integer"),
        ("count", True, "count: expected an integer"),
        ("zero_ok", "-1", "zero_ok: must be at least 0"),
        ("flag", "perhaps", "flag: expected true or false"),
        ("mode", "slow", "mode must be one of fast, safe"),
        ("colour", "green", "colour must be one of red, blue"),
        ("context", "not a context", "context must be a ssl.SSLContext"),
        ("label", None, "label: a value is required"),
    ],
)
def test_bad_values_name_the_field(name: str, value: Any, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        convert_fields(Knobs, {name: value})


def test_unknown_fields_list_the_known_ones() -> None:
    with pytest.raises(ConfigurationError) as err:
        convert_fields(Knobs, {"cuont": 1, "lable": "x"}, what="knob")
    text = str(err.value)
    assert text.startswith("unknown knobs 'cuont', 'lable'; known knobs: colour, context")
    with pytest.raises(ConfigurationError, match="unknown setting 'batch_sise'; known settings"):
        load_settings({"batch_sise": 5}, env={})


def test_a_field_type_with_no_conversion_fails_at_definition() -> None:
    with pytest.raises(TypeError, match=r"Broken\.items: no conversion for the type"):

        @checked
        @dataclass(frozen=True)
        class Broken:
            items: list[str]

    @dataclass(frozen=True)
    class Union2:
        either: int | str = 0

    with pytest.raises(TypeError, match="either"):
        field_converters(Union2)


def test_settings_fields_are_all_derived() -> None:
    converters = field_converters(Settings)
    assert set(converters) == {f for f in Settings.__dataclass_fields__}
    settings = load_settings(
        {"reap_interval": "2s", "cleanup_batch": "50", "delete_on_send": "on", "schema": "app"},
        env={"OUTBOX_RUN_LENGTH": "3"},
    )
    assert settings.reap_interval == 2.0
    assert settings.cleanup_batch == 50
    assert settings.delete_on_send is True
    assert settings.schema == "app"
    assert settings.run_length == 3
    assert settings.replace(lease="1m").lease == 60.0
    with pytest.raises(ConfigurationError, match="run_length: must be at least 1"):
        settings.replace(run_length=0)


def test_the_brokers_shared_converters() -> None:
    count = optional_count("bytes")
    assert count("1000", "max_message_size") == 1000
    assert count(0, "max_message_size") is None
    assert count(" None ", "max_message_size") is None
    for bad in ("ten", -1, True):
        with pytest.raises(
            ConfigurationError, match="max_message_size: expected a number of bytes"
        ):
            count(bad, "max_message_size")
    assert cloudevents_source("urn:orders", "source") == "urn:orders"
    with pytest.raises(ConfigurationError, match="white space"):
        cloudevents_source("a b", "source")
