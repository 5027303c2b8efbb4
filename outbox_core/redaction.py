"""Passwords out of everything printed or logged: URLs and free text.

Masking does not trust a URL to be well formed: a scheme separator typed as
``scheme//`` or ``scheme:/``, no scheme at all, a password holding ``@``,
``:`` or ``/``, a URL percent-encoded inside another one: anything shaped
like ``user:password@`` has its password replaced by ``***``.
"""

from __future__ import annotations

import re

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


def redact(text: str) -> str:
    """Mask every ``user:password@`` found in free text (log lines, errors), whatever its shape."""
    text = _USERINFO.sub(lambda m: f"{m.group('head')}***@", text)
    return _ENCODED_USERINFO.sub(lambda m: f"{m.group('head')}***%40", text)


def mask_url(url: object) -> str:
    """The URL with its password replaced by ``***``: safe to print or log.

    A well-formed URL keeps everything but its password; a malformed one
    (``amqp//user:password@host``) is masked just the same, never printed whole.
    """
    return redact(str(url))
