"""The NATS broker's options (:class:`NatsOptions`), converted from strings by their types."""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from typing import Any, Final, Literal

from outbox_core.brokers import cloudevents
from outbox_core.brokers.converters import cloudevents_source
from outbox_core.errors import ConfigurationError
from outbox_core.fields import checked, setting

DEFAULT_CONNECTION_NAME: Final = "outbox-toolkit relay"

Envelope = Literal["plain", "cloudevents", "cloudevents-binary"]


def _as_file(value: Any, name: str) -> str:
    path = os.path.expanduser(str(value))
    if not os.path.isfile(path):
        raise ConfigurationError(f"{name}: no such file: {value!r}")
    return path


@checked
@dataclass(frozen=True)
class NatsOptions:
    """The NATS broker's options, converted from strings by their field types.

    See :mod:`outbox_core.brokers.nats` for what each one does.
    """

    #: The message: ``plain`` (the payload's JSON), ``cloudevents`` (the CloudEvents
    #: JSON document) or ``cloudevents-binary`` (the payload, ``ce-`` headers).
    envelope: Envelope = "plain"
    #: The CloudEvents ``source`` attribute (a URI-reference without white space); used
    #: by the ``cloudevents`` envelopes only.
    source: str = setting(cloudevents.DEFAULT_SOURCE, convert=cloudevents_source)
    #: Seconds (or ``10s``) to wait for a batch's JetStream acknowledgements; past it
    #: the unacknowledged events are unavailable (no attempt spent), the connection reopened.
    ack_timeout: float = setting(10.0, positive=True)
    #: Seconds (or ``5s``) to connect; nats-py's own connect timeout takes it rounded to
    #: whole seconds (at least 1).
    connect_timeout: float = setting(5.0, positive=True)
    #: Longest wait between connection attempts while NATS stays unreachable, in seconds
    #: (or ``30s``); the waits start at 0.5 s and double.
    reconnect_max: float = 30.0
    #: The client's name, shown by the server's monitoring (``connz``).
    connection_name: str = DEFAULT_CONNECTION_NAME
    #: A ``.creds`` file (JWT and NKey seed) to authenticate with; it must exist.
    creds: str | None = setting(None, convert=_as_file)
    #: Connect with TLS, checking the server against the system's CAs; a server that
    #: does not require TLS is refused before any credentials are sent.
    tls: bool = False
    #: A CA file to check the server's certificate against; implies ``tls``.
    tls_ca: str | None = setting(None, convert=_as_file)
    #: An ``ssl.SSLContext`` (Python only); implies ``tls`` and wins over ``tls_ca``.
    ssl_context: ssl.SSLContext | None = None

    def tls_context(self) -> ssl.SSLContext | None:
        """The TLS context to connect with (None: no TLS): ``ssl_context``, ``tls_ca``, ``tls``."""
        if self.ssl_context is not None:
            return self.ssl_context
        if self.tls_ca is not None:
            return ssl.create_default_context(cafile=self.tls_ca)
        if self.tls:
            return ssl.create_default_context()
        return None
