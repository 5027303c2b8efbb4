"""Passwords out of everything printed or logged: URLs and free text."""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit


def mask_url(url: object) -> str:
    """The URL with its password replaced by ``***``: safe to print or log."""
    text = str(url)
    try:
        parts = urlsplit(text)
    except ValueError:
        return _mask_text(text)
    if parts.password is None:
        return text
    userinfo, _, hostinfo = parts.netloc.rpartition("@")
    user = userinfo.split(":", 1)[0]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{hostinfo}"))


_URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://[^:/@\s]*:)(?P<pw>[^@\s]+)@")


def _mask_text(text: str) -> str:
    return _URL_PASSWORD.sub(lambda m: f"{m.group('head')}***@", text)


def redact(text: str) -> str:
    """Mask every ``scheme://user:password@`` found in free text (log lines, errors)."""
    return _mask_text(text)
