"""Passwords out of everything printed or logged: URLs and free text.

Masking does not trust a URL to be well formed: a scheme separator typed as
``scheme//`` or ``scheme:/``, no scheme at all, a password holding ``@``,
``:``, ``/`` or a space, a URL percent-encoded inside another one: anything
shaped like ``user:password@`` has its password replaced by ``***``, and so
has the value of a query parameter named like a secret (``?password=``,
``&sslpassword=``, ``token``, ``secret``, ``api_key``...).
"""

from __future__ import annotations

import re
from typing import Any

#: ``user:password@`` anywhere in text. The user holds no separator, quote or
#: bracket, so ``scheme://``, ``--db=`` or a quote stay outside it. The
#: password may not start with ``/`` (``scheme://u:p@`` is user ``u``, not user
#: ``scheme``) and runs to the LAST ``@`` before whitespace, so a password
#: holding ``@``, ``:`` or ``/`` is masked whole: an ``@`` later in the same
#: word masks too much rather than too little.
_USERINFO = re.compile(r"(?P<head>[^\s:/@'\"`=()\[\]{}<>,;|\\]*:)[^\s/][^\s]*@")

#: The same, percent-encoded (``user%3Apassword%40host``: a URL carried in a
#: query string); ``%2F`` after the ``%3A`` is a scheme's ``://``, not a password.
_ENCODED_USERINFO = re.compile(
    r"(?P<head>[A-Za-z0-9._~!$&+\-]*%3A)(?!%2F)[^\s/]+%40", re.IGNORECASE
)


#: After a scheme, a password holding a space (SQLAlchemy renders a
#: ``%20`` in a password as a space): it runs to the first ``@``, never
#: into the next URL.
_SPACED_USERINFO = re.compile(
    r"(?P<head>[A-Za-z][A-Za-z0-9+.\-]*:/*[^\s:/@'\"]*:)(?:(?!://)[^@\n])*?@"
)

#: A query parameter whose name says it holds a secret.
SECRET_NAME = re.compile(
    r"pass(word|wd)?|pwd|secret|token|credential|signature|"
    r"(api|access|private|secret|ssl|client)[_\-.]?key|apikey",
    re.IGNORECASE,
)

#: ``?name=value`` / ``&name=value`` with such a name: the value runs to the next
#: parameter. Percent-encoded (a URL inside another's query: ``%3F``, ``%26``,
#: ``%3D``), it runs to the next encoded ``%26``.
_SECRET_PARAM = re.compile(
    r"(?P<head>[?&;](?P<name>[A-Za-z0-9_.\-]+)=)(?P<value>[^&\s#'\"]*)"
    r"|(?P<ehead>(?:%3F|%26)(?P<ename>[A-Za-z0-9_.\-]+)%3D)(?P<evalue>(?:(?!%26)[^&\s#'\"])*)",
    re.IGNORECASE,
)


def _secret_param(match: re.Match[str]) -> str:
    encoded = match.group("head") is None
    name, value = match.group("ename", "evalue") if encoded else match.group("name", "value")
    if not SECRET_NAME.search(name) or not value:
        return match.group(0)
    return f"{match.group('ehead' if encoded else 'head')}***"


def redact(text: str) -> str:
    """Mask every password found in free text (log lines, errors), whatever its shape."""
    text = _USERINFO.sub(lambda m: f"{m.group('head')}***@", text)
    text = _SPACED_USERINFO.sub(lambda m: f"{m.group('head')}***@", text)
    text = _ENCODED_USERINFO.sub(lambda m: f"{m.group('head')}***%40", text)
    return _SECRET_PARAM.sub(_secret_param, text)


def mask_url(url: object) -> str:
    """The URL with its password replaced by ``***``: safe to print or log.

    A SQLAlchemy ``URL`` is masked by its parts (the password, and every query
    parameter named like a secret) before it is rendered; any other value is
    masked as text, so a malformed URL (``amqp//user:password@host``) is
    masked just the same, never printed whole.
    """
    return redact(_masked_parts(url) if _is_sqlalchemy_url(url) else str(url))


def _is_sqlalchemy_url(url: object) -> bool:
    return type(url).__name__ == "URL" and hasattr(url, "render_as_string")


def _masked_parts(url: Any) -> str:
    query = {
        name: "***" if SECRET_NAME.search(name) else value for name, value in url.query.items()
    }
    password = None if url.password is None else "***"
    masked = url.set(password=password, query=query)
    return str(masked.render_as_string(hide_password=False))
