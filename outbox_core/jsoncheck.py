"""JSON as the outbox stores it: one serialisation, and the field that breaks it.

:func:`check_json` serialises a payload (or headers) once, UTF-8 and not
ASCII escapes, and when that fails walks the value to name the first field
that is not JSON: a type JSON has no form for, NaN, a circular reference, a
lone surrogate, nesting deeper than :data:`MAX_JSON_DEPTH`, or two keys JSON
would merge. :func:`find_in_json` walks a value's strings for the dialects'
own storage rules.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import Any

from outbox_core.errors import PayloadError

#: Deepest nesting of arrays and objects a payload or headers may have on any
#: database (MySQL 8's own limit; Python's JSON parser, which relays and
#: consumers use, fails far deeper). A dialect can set a lower one (MariaDB: 31).
MAX_JSON_DEPTH = 100

_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_JSON_BRACKET = re.compile(r"[\[\]{}]")


def json_depth(text: str, limit: int) -> int | None:
    """The nesting depth of arrays and objects in the JSON ``text`` when over ``limit``, else None.

    Fast for the usual payload: with no more brackets than ``limit`` it cannot
    be deeper, and the text is not scanned. Brackets inside strings do not count.
    """
    if text.count("[") + text.count("{") <= limit:
        return None
    depth = deepest = 0
    for bracket in _JSON_BRACKET.findall(_JSON_STRING.sub("", text)):
        if bracket in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest if deepest > limit else None


def value_depth(value: Any) -> int:
    """The nesting depth of lists and dicts in ``value``, walked without recursion."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    seen: set[int] = set()
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        if id(item) in seen:
            continue  # a circular reference: reported as such elsewhere
        seen.add(id(item))
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def _too_deep(name: str, depth: int, limit: int, where: str = "") -> str:
    return (
        f"{name} is nested {depth} deep (arrays and objects); the limit{where} is {limit}: "
        "flatten it"
    )


#: Converts a value JSON cannot hold into one it can (``json.dumps``'s ``default``).
JsonDefault = Callable[[Any], Any]

_PLAIN = (str, int, float, bool, type(None))


def holds_non_json(value: Any) -> bool:
    """Does ``value`` hold anything but JSON's own types (so an encoder changed it)?"""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if not all(isinstance(k, str) for k in item):
                return True
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif not isinstance(item, _PLAIN):
            return True
    return False


def dump_json(value: Any, default: JsonDefault | None = None) -> str:
    """``value`` as JSON text: UTF-8 characters, not ``\\uXXXX`` escapes; NaN refused."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False, default=default)


def check_json(value: Any, name: str, default: JsonDefault | None = None) -> str:
    """``value`` as JSON text; :class:`PayloadError` naming the first field that is not JSON.

    Refused as well: text with a lone surrogate (half of a UTF-16 pair), which
    is not Unicode and which no database stores. The fast path is one
    ``json.dumps``; the walk that finds the field runs only when it fails.
    """
    try:
        text = dump_json(value, default)
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        found = find_in_json(value, name, _surrogate)
        raise PayloadError(found or f"{name}: contains a lone surrogate") from exc
    except RecursionError as exc:
        # Deeper than Python's own recursion: say how deep, walking without recursion.
        raise PayloadError(_too_deep(name, value_depth(value), MAX_JSON_DEPTH)) from exc
    except (TypeError, ValueError) as exc:
        path, reason = _find_bad(value, name, set(), default)
        raise PayloadError(f"{path}: {reason}") from exc
    depth = json_depth(text, MAX_JSON_DEPTH)
    if depth is not None:
        raise PayloadError(_too_deep(name, depth, MAX_JSON_DEPTH))
    merged = _merged_keys(value, name)
    if merged is not None:
        raise PayloadError(merged)
    return text


def _json_key(key: Any) -> str:
    """The object key ``json.dumps`` writes for a dict key."""
    if isinstance(key, str):
        return key
    return json.dumps(key) if isinstance(key, bool | None) else str(key)


def _merged_keys(value: Any, name: str) -> str | None:
    """Where two keys of one dict become the same JSON key (``1`` and ``"1"``), and why.

    JSON objects have text keys: ``json.dumps`` writes ``1``, ``1.0``... as
    text, and a reader keeps the last of two equal keys, so one value would
    be lost. Only dicts with a key that is not text can merge.
    """
    stack: list[tuple[str, Any]] = [(name, value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, dict):
            if not all(type(k) is str for k in item):
                seen: dict[str, Any] = {}
                for key in item:
                    text = _json_key(key)
                    if text in seen:
                        return (
                            f"{path}: keys {seen[text]!r} and {key!r} are the same key in "
                            "JSON (object keys are text): one value would be lost"
                        )
                    seen[text] = key
            stack.extend((f"{path}[{k!r}]", v) for k, v in item.items() if _is_container(v))
        elif isinstance(item, list | tuple):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(item) if _is_container(v))
    return None


def _is_container(value: Any) -> bool:
    return isinstance(value, dict | list | tuple)


def _surrogate(path: str, text: str) -> str | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return f"{path} contains a lone surrogate (not valid Unicode)"
    return None


def find_in_json(value: Any, path: str, problem: Callable[[str, str], str | None]) -> str | None:
    """The first ``problem(path, text)`` of the strings (and keys) of a JSON value.

    Paths read like ``payload['items'][2]`` and ``payload key 'x'``. Used by
    the dialects' storage rules (what a database cannot store) at enqueue and
    in ``outbox migrate``.
    """
    if isinstance(value, str):
        return problem(path, value)
    if isinstance(value, dict):
        for k, v in value.items():
            found = (isinstance(k, str) and problem(f"{path} key {k!r}", k)) or find_in_json(
                v, f"{path}[{k!r}]", problem
            )
            if found:
                return found
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            found = find_in_json(v, f"{path}[{i}]", problem)
            if found:
                return found
    return None


def _find_bad(
    value: Any, path: str, seen: set[int], default: JsonDefault | None = None
) -> tuple[str, str]:
    if isinstance(value, float) and not math.isfinite(value):
        return path, f"{value!r} is not valid JSON (NaN and infinity are not allowed)"
    if value is None or isinstance(value, str | int | float | bool):
        return path, "cannot be serialised to JSON"
    if isinstance(value, dict | list | tuple):
        if id(value) in seen:
            return path, "contains a circular reference"
        seen.add(id(value))
        if isinstance(value, dict):
            for k, v in value.items():
                if not isinstance(k, str | int | float | bool) and k is not None:
                    return path, f"key {k!r} of type {type(k).__name__} is not a JSON object key"
                found = _find_bad_or_none(v, f"{path}[{k!r}]", seen, default)
                if found:
                    return found
        else:
            for i, v in enumerate(value):
                found = _find_bad_or_none(v, f"{path}[{i}]", seen, default)
                if found:
                    return found
        seen.discard(id(value))
        return path, "cannot be serialised to JSON"
    if default is not None:
        try:
            converted = default(value)
        except Exception as exc:  # the encoder's own refusal, named
            return path, (
                f"value of type {type(value).__name__} is not JSON serialisable and the "
                f"json_default encoder refused it ({type(exc).__name__}: {exc})"
            )
        return _find_bad(converted, path, seen, default)
    return path, (
        f"value of type {type(value).__name__} is not JSON serialisable "
        "(convert it before enqueue, or give the outbox a json_default encoder)"
    )


def _find_bad_or_none(
    value: Any, path: str, seen: set[int], default: JsonDefault | None
) -> tuple[str, str] | None:
    try:
        json.dumps(value, allow_nan=False, default=default)
    except (TypeError, ValueError, RecursionError):
        return _find_bad(value, path, seen, default)
    return None
