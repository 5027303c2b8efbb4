"""Who may change what through the dashboard: the token, signed sessions, CSRF checks.

The dashboard is read-only unless an operator token is configured, from the
environment (``OUTBOX_DASHBOARD_TOKEN``) or a file, never the command line
(``ps`` would show it). A browser signs in once with the token and gets a
session cookie signed with a key derived from it (changing the token ends
every session); scripts send ``Authorization: Bearer <token>`` instead.
Every change is a POST that also carries a CSRF token matching its cookie
(double submit) and, where the browser sends one, an ``Origin`` of the
dashboard's own host.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from outbox_core.errors import ConfigurationError

#: The environment variable holding the operator token.
TOKEN_ENV = "OUTBOX_DASHBOARD_TOKEN"
SESSION_COOKIE = "outbox_session"
CSRF_COOKIE = "outbox_csrf"
#: How long a browser session lasts.
SESSION_SECONDS = 8 * 3600
#: A token shorter than this is refused: it would be guessed.
MIN_TOKEN_LENGTH = 16


def load_token(token_file: str | Path | None = None) -> str | None:
    """The operator token from ``token_file``, else ``OUTBOX_DASHBOARD_TOKEN``; None: read-only."""
    if token_file is not None:
        try:
            token = Path(token_file).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ConfigurationError(f"dashboard token file: {exc.strerror}: {token_file}") from exc
        source = f"the token file {token_file}"
    else:
        token = os.environ.get(TOKEN_ENV, "").strip()
        if not token:
            return None
        source = TOKEN_ENV
    if len(token) < MIN_TOKEN_LENGTH:
        raise ConfigurationError(
            f"dashboard token from {source} is shorter than {MIN_TOKEN_LENGTH} characters; "
            "make one with: python -c 'import secrets; print(secrets.token_urlsafe(32))'"
        )
    return token


@dataclass(frozen=True)
class Guard:
    """Checks a request's right to change things (``token`` None: nobody may)."""

    token: str | None

    @property
    def writable(self) -> bool:
        """A token is configured: replays are possible."""
        return self.token is not None

    def _key(self) -> bytes:
        assert self.token is not None
        # A key of its own, so that a session cookie never holds anything the token could
        # be recovered from.
        return hashlib.sha256(b"outbox-dashboard-session:" + self.token.encode()).digest()

    def token_matches(self, offered: str | None) -> bool:
        """``offered`` is the operator token (in constant time)."""
        if self.token is None or not offered:
            return False
        return hmac.compare_digest(offered.encode(), self.token.encode())

    def bearer_ok(self, authorization: str | None) -> bool:
        """An ``Authorization: Bearer <token>`` header carrying the token."""
        if not authorization:
            return False
        scheme, _, value = authorization.partition(" ")
        return scheme.lower() == "bearer" and self.token_matches(value.strip())

    def new_session(self, now: float | None = None) -> str:
        """A session cookie's value: its expiry and a nonce, signed."""
        expires = int((now or time.time()) + SESSION_SECONDS)
        body = f"{expires}.{secrets.token_urlsafe(16)}"
        return f"{body}.{self._sign(body)}"

    def session_ok(self, cookie: str | None, now: float | None = None) -> bool:
        """``cookie`` is a session this token signed, not expired."""
        if self.token is None or not cookie or cookie.count(".") != 2:
            return False
        body, _, signature = cookie.rpartition(".")
        if not hmac.compare_digest(signature, self._sign(body)):
            return False
        expires = body.partition(".")[0]
        return expires.isdigit() and int(expires) > (now or time.time())

    def _sign(self, body: str) -> str:
        return hmac.new(self._key(), body.encode(), hashlib.sha256).hexdigest()


def new_csrf() -> str:
    """A fresh CSRF token (the cookie and every form carry it)."""
    return secrets.token_urlsafe(24)


def csrf_ok(cookie: str | None, field: str | None) -> bool:
    """The form's CSRF token matches its cookie (double submit)."""
    return bool(cookie and field) and hmac.compare_digest(str(cookie), str(field))


def same_origin(origin: str | None, host: str | None) -> bool:
    """A POST's ``Origin`` names the dashboard's own host (no ``Origin``: not a browser's
    cross-site form, which always sends one)."""
    if not origin:
        return True
    if origin == "null" or not host:
        return False
    return urlsplit(origin).netloc.lower() == host.lower()
