"""Where the fleet machine runs: throwaway schemas (MySQL, MariaDB: databases) of its own.

A :class:`World` creates a few schemas named ``<prefix>_<n>``, each holding
an outbox table, on the server a URL names; the machine's relays find them
by the pattern ``<prefix>_*``, as ``outbox relay --schemas`` does. Schemas
are added and dropped while relays run; :meth:`World.close` drops every one
left. Each fleet also gets a second database URL on a port nobody listens
on: a database that never answers, which must hold none of the others back.
"""

from __future__ import annotations

import socket
import uuid
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from outbox_core.config import Settings
from outbox_core.dialects.base import get_dialect
from outbox_core.errors import UnsupportedDatabase
from outbox_core.message import State
from outbox_core.outbox import Outbox
from outbox_core.schema import OutboxTables

#: Schemas each example starts with.
BASE_SCHEMAS = 3


def closed_port_url(url: sa.URL) -> str:
    """``url`` pointed at a loopback port nobody listens on (now): connections are refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    return url.set(host="127.0.0.1", port=port).render_as_string(hide_password=False)


def fleet_unsupported(url: str) -> str | None:
    """Why a fleet of schemas cannot run on ``url``'s database (None: it can)."""
    dialect = get_dialect(sa.make_url(url).get_backend_name())(OutboxTables.create())
    if dialect.schema_kind is None:
        return (
            f"{dialect.family} has no schemas: a fleet there is one database file per "
            "outbox (--db repeated), with nothing of the server's to prove"
        )
    return None


@dataclass
class Place:
    """One outbox the world created: a schema, and which incarnation of that name."""

    name: str
    outbox: Outbox
    #: ``name#n``: a schema dropped and created again is another outbox.
    key: str


@dataclass
class World:
    """The schemas, table and database URLs a fleet machine runs on."""

    url: str
    table: str = field(default_factory=lambda: f"outbox_verify_{uuid.uuid4().hex[:8]}")
    prefix: str = field(default_factory=lambda: f"outbox_verify_f{uuid.uuid4().hex[:6]}")
    engine: sa.Engine = field(init=False)
    #: The outboxes that exist now, by schema name.
    live: dict[str, Place] = field(default_factory=dict)
    made: int = 0
    dead_url: str = field(init=False)

    def __post_init__(self) -> None:
        # One engine for the world's own statements and every producer: a pool
        # large enough that the machine's reads never wait on the producers.
        self.engine = sa.create_engine(self.url, pool_size=4, max_overflow=8)
        self.dead_url = closed_port_url(sa.make_url(self.url))

    @property
    def pattern(self) -> str:
        """What the fleets' ``schemas`` setting matches."""
        return f"{self.prefix}_*"

    def settings(self, **changes: Any) -> Settings:
        """The settings of the machine's relays: heads order, one dead database, no timers."""
        options: dict[str, Any] = {
            "database_url": self.url,
            "database_urls": (self.dead_url,),
            "schemas": self.pattern,
            "table": self.table,
            "ordering": "heads",
            "batch_size": 4,
            "lease": 30.0,
            "notify": False,
            "max_attempts": 1000,
            "backoff_base": 0.0,
            "reap_interval": 0.001,
            # Rediscovery is a rule of its own (and slow on MariaDB): upkeep never runs it.
            "discover_interval": 3600.0,
            "cleanup_after": 0.0,
            "poll_interval": 0.01,
            "max_poll_interval": 0.05,
        }
        options.update(changes)
        return Settings(**options)

    def create(self, name: str | None = None) -> Place:
        """Create a schema holding an installed outbox (a new name unless ``name``)."""
        self.made += 1
        name = name or f"{self.prefix}_{self.made}"
        with self.engine.begin() as conn:
            conn.execute(sa.schema.CreateSchema(name))
        outbox = Outbox(self.engine, table=self.table, schema=name, notify=False)
        outbox.install()
        place = Place(name, outbox, f"{name}#{self.made}")
        self.live[name] = place
        return place

    def drop(self, name: str) -> Place:
        """Drop a schema and its outbox (tables first: SQL Server's DROP SCHEMA has no CASCADE)."""
        place = self.live.pop(name)
        place.outbox.tables.metadata.drop_all(self.engine)
        with self.engine.begin() as conn:
            conn.execute(sa.schema.DropSchema(name))
        return place

    def start(self) -> None:
        """At least :data:`BASE_SCHEMAS` outboxes, none holding unsent events (a failed
        example may leave some); the last example's others are kept (schemas are slow to make)."""
        for name in [n for n, place in self.live.items() if self._unsent(place.outbox)]:
            self.drop(name)
        while len(self.live) < BASE_SCHEMAS:
            self.create()

    def check(self) -> None:
        """Refuse a server that cannot serve ordered claims (the machine reads while claims run)."""
        reason = fleet_unsupported(self.url)
        if reason:
            raise UnsupportedDatabase(reason)
        probe = Outbox(self.engine, table=self.table)
        with self.engine.connect() as conn:
            probe.dialect.check(conn)
            probe.dialect.check_ordered(conn)

    @staticmethod
    def _unsent(outbox: Outbox) -> bool:
        t = outbox.table
        with outbox.engine.connect() as conn:
            found = conn.execute(
                sa.select(sa.func.count()).select_from(t).where(t.c.state != int(State.SENT))
            ).scalar_one()
        return bool(found)

    def close(self) -> None:
        """Drop every schema left and close the engine."""
        try:
            for name in list(self.live):
                self.drop(name)
        finally:
            self.engine.dispose()
