"""What a URL needs: the sync driver a database URL runs on, and the extra that installs it.

The relay is synchronous, so an async or driver-less database URL is mapped
to the sync driver the toolkit ships with (:func:`sync_url`). When a URL's
driver or broker client is not installed, :func:`install_command` names the
``pip install`` that brings it.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.engine import URL, make_url

from outbox_core.errors import ConfigurationError
from outbox_core.redaction import mask_url

#: A database URL's driver name (async, or none) -> the sync driver the relay runs on.
RELAY_DRIVERS: dict[str, str] = {
    "postgresql": "postgresql+psycopg",
    "postgresql+psycopg_async": "postgresql+psycopg",
    "postgresql+asyncpg": "postgresql+psycopg",
    "mysql": "mysql+pymysql",
    "mysql+aiomysql": "mysql+pymysql",
    "mysql+asyncmy": "mysql+pymysql",
    "mariadb": "mariadb+pymysql",
    "mariadb+aiomysql": "mariadb+pymysql",
    "mariadb+asyncmy": "mariadb+pymysql",
    "mssql": "mssql+pyodbc",
    "mssql+aioodbc": "mssql+pyodbc",
    "sqlite+aiosqlite": "sqlite",
}

#: What a URL names -> the extra of outbox-toolkit that installs it: a database
#: URL's driver (``psycopg``) or a broker URL's scheme (``amqp``).
EXTRAS: dict[str, str] = {
    "psycopg": "postgresql",
    "pymysql": "mysql",
    "pyodbc": "mssql",
    "aiosqlite": "sqlite-async",
    "amqp": "rabbitmq",
    "amqps": "rabbitmq",
    "http": "webhook",
    "https": "webhook",
    "kafka": "kafka",
    "nats": "nats",
    "redis": "redis",
    "rediss": "redis",
}


def install_command(name: str) -> str | None:
    """``pip install 'outbox-toolkit[extra]'`` for a driver or scheme :data:`EXTRAS` knows."""
    extra = EXTRAS.get(name)
    return f"pip install 'outbox-toolkit[{extra}]'" if extra else None


def sync_url(url: str | URL) -> URL:
    """The URL with a sync driver the toolkit supports (the relay is synchronous).

    A URL without ``://`` (``postgresql+psycopg//user:pw@host``, a typo) is
    refused first, by name and masked, before a parser can echo it whole.
    """
    if isinstance(url, str) and "://" not in url:
        raise ConfigurationError(
            f"invalid database URL {mask_url(url)!r}: '://' is missing after the scheme "
            "(e.g. postgresql+psycopg://user@host/db)"
        )
    try:
        parsed = make_url(url)
    except (sa.exc.ArgumentError, ValueError) as exc:
        # ValueError: a port that is not a number ("invalid literal for int()").
        reason = "the port must be a number" if "int()" in str(exc) else str(exc)
        raise ConfigurationError(
            f"invalid database URL {mask_url(url)!r}: {mask_url(reason)}"
        ) from None
    target = RELAY_DRIVERS.get(parsed.drivername)
    return parsed.set(drivername=target) if target else parsed


def missing_driver_error(url: URL, exc: ImportError) -> ConfigurationError:
    """A clear error for a database URL whose driver is not installed."""
    driver = url.get_driver_name()
    command = install_command(driver)
    hint = f": {command}" if command else ""
    return ConfigurationError(
        f"the {driver} driver for {mask_url(url)} is not installed{hint} ({exc})"
    )
