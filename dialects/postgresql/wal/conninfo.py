"""libpq keywords of a replication connection (psycopg2) from a SQLAlchemy URL."""

from __future__ import annotations

import sqlalchemy as sa

from outbox_core.dialects.postgresql.wal.names import masked_url
from outbox_core.errors import ConfigurationError

#: what load_text expects whatever the server's defaults.
SESSION = {
    "datestyle": "ISO",
    "timezone": "UTC",
    "intervalstyle": "postgres",
    "bytea_output": "hex",
    "extra_float_digits": "3",
}


def replication_conninfo(
    url: str | sa.URL,
    *,
    wal_sender_timeout: float | None = None,
    connect_timeout: float = 10.0,
    application_name: str = "outbox-wal-reader",
) -> dict[str, str]:
    """libpq keywords for psycopg2 from a SQLAlchemy URL (``postgresql+psycopg://...``).

    The URL's query (``sslmode``, ``host`` of a socket directory...) is kept;
    ``options`` gets the session settings the decoder relies on and, if
    given, ``wal_sender_timeout``: how long the server keeps the slot of a
    reader that stopped answering.
    """
    parsed = sa.engine.make_url(url)
    if parsed.get_backend_name() != "postgresql":
        raise ConfigurationError(f"not a PostgreSQL URL: {masked_url(parsed)}")
    args: dict[str, str] = {}
    for key, value in parsed.query.items():
        args[key] = value if isinstance(value, str) else ",".join(value)
    for key, value in parsed.translate_connect_args(username="user", database="dbname").items():
        args[key] = str(value)
    settings = dict(SESSION)
    if wal_sender_timeout is not None:
        settings["wal_sender_timeout"] = f"{max(1, round(wal_sender_timeout * 1000))}ms"
    options = " ".join(f"-c {k}={v}" for k, v in settings.items())
    args["options"] = f"{args['options']} {options}" if "options" in args else options
    args["client_encoding"] = "UTF8"
    args["connect_timeout"] = str(max(1, round(connect_timeout)))
    args.setdefault("application_name", application_name)
    return args
