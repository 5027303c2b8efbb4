"""The outboxes settings name: one per database URL, or one per schema matching a pattern.

``--db`` repeated (``database_url`` and ``database_urls``) names databases;
``--schemas tenant_*`` (``schemas``) turns each database into the outboxes
of its schemas (MySQL, MariaDB: its server's databases) that hold the table.
Every outbox of one database shares that database's engine. Each outbox has
a short name, its *label*, used in output, metrics and weights: the schema's
name, else the database's, made unique by more of the URL where two agree.
"""

from __future__ import annotations

import collections
import dataclasses
import fnmatch
from collections.abc import Iterator, Sequence
from pathlib import PurePath
from typing import Any

from sqlalchemy.engine import URL, Connection

from outbox_core.config import Settings
from outbox_core.dialects.base.discovery import schemas_holding, schemas_matching
from outbox_core.errors import ConfigurationError, translate_errors
from outbox_core.outbox import Outbox
from outbox_core.redaction import mask_url

#: Compiled statements an engine of many outboxes keeps: about 15 per outbox for 1,000.
COMPILED_STATEMENTS = 15_000


def database_urls(settings: Settings) -> list[str]:
    """Every database URL of ``settings``, the first as given, repeats dropped."""
    urls = [u for u in (settings.database_url, *settings.database_urls) if u]
    if not urls:
        raise ConfigurationError(
            "no database URL: pass --db, set OUTBOX_DATABASE_URL, or database_url in outbox.toml"
        )
    return list(dict.fromkeys(urls))


def is_many(settings: Settings) -> bool:
    """Do the settings name more than one outbox, or a pattern of them?"""
    return settings.schemas is not None or len(database_urls(settings)) > 1


def table_of(outbox: Outbox, schema: str | None) -> tuple[object, ...]:
    """Which table ``outbox``'s database holds in ``schema``: the same for two URLs of one
    MySQL/MariaDB server (its databases are its schemas) or of one PostgreSQL database."""
    url = outbox.url
    if outbox.dialect.schema_kind == "database":
        return url.get_backend_name(), url.host, url.port, schema or url.database
    return url.get_backend_name(), url.host, url.port, url.database, schema


def outbox_for(
    settings: Settings,
    db: str | object,
    schema: str | None,
    engine_options: dict[str, Any] | None = None,
) -> Outbox:
    """The outbox on ``db`` (a URL or a shared Engine) in ``schema``, as ``settings`` say."""
    outbox = Outbox(
        db,  # type: ignore[arg-type]
        engine_options=engine_options,
        table=settings.table,
        schema=schema,
        columns=settings.columns,
        dialect=settings.dialect,
        block_on_dead=settings.block_on_dead,
        notify=settings.notify,
    )
    # Where its relays read (the doctor checks a log-tailing slot by these).
    outbox.settings = outbox.settings.replace(
        source=settings.source, slot=settings.slot, publication=settings.publication
    )
    return outbox


@dataclasses.dataclass
class Member:
    """One outbox of many: its label, the outbox, and the database it is in."""

    label: str
    outbox: Outbox
    #: The database (its URL, password masked): outboxes of one database share it.
    database: str

    @property
    def schema(self) -> str | None:
        """The outbox's schema (MySQL: its database); None: the connection's default."""
        return self.outbox.tables.outbox.schema


class Databases:
    """One engine per database URL of the settings, and the outboxes found in each.

    :meth:`find` lists the outboxes now (a pattern of schemas looks again at
    each call); :meth:`close` disposes of the engines.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        #: One outbox per database URL, owning the engine its schemas share.
        # Each outbox's statements name its own table: SQLAlchemy's cache of compiled
        # statements (500 by default) must hold those of hundreds of outboxes.
        options = {"query_cache_size": COMPILED_STATEMENTS}
        self.bases = [
            outbox_for(settings, url, settings.schema, options) for url in database_urls(settings)
        ]
        if settings.schemas is not None:
            for base in self.bases:
                if base.dialect.schema_kind is None:
                    raise ConfigurationError(
                        f"--schemas {settings.schemas}: {base.dialect.family} has no schemas "
                        f"({mask_url(base.url)}); name each database with --db instead"
                    )

    def __iter__(self) -> Iterator[Outbox]:
        return iter(self.bases)

    def names_in(
        self, conn: Connection | None, base: Outbox, *, installing: bool = False
    ) -> list[str | None]:
        """The schemas of ``base``'s database that are outboxes (one statement), on
        ``conn`` or a connection of its own.

        ``installing``: every schema matching the pattern, the table there or
        not (``outbox install`` creates it).
        """
        pattern = self.settings.schemas
        if pattern is None:
            return [base.tables.outbox.schema]
        if conn is None:
            with translate_errors("discover"), base.engine.connect() as own:
                return self.names_in(own, base, installing=installing)
        # A transaction of its own: the relay's connections never keep one open.
        with base.dialect.transaction(conn):
            if installing:
                return list(schemas_matching(conn, pattern))
            return list(schemas_holding(conn, base.tables.outbox.name, pattern))

    def members_in(self, base: Outbox, names: Sequence[str | None]) -> list[Member]:
        """The outboxes of ``base``'s database in schemas ``names`` (unlabelled: see
        :func:`label`)."""
        database = mask_url(base.url)
        out = []
        for name in names:
            outbox = base if name == base.tables.outbox.schema else None
            outbox = outbox or outbox_for(self.settings, base.engine, name)
            out.append(Member("", outbox, database))
        return out

    def find(self, *, installing: bool = False) -> list[Member]:
        """Every outbox now, labelled, in the order of the URLs and then by schema."""
        members: list[Member] = []
        for base in self.bases:
            members += self.members_in(base, self.names_in(None, base, installing=installing))
        return label(members)

    def close(self) -> None:
        """Dispose of every engine."""
        for base in self.bases:
            base.dispose()


def _database_name(url: URL) -> str:
    if url.get_backend_name() == "sqlite":
        return PurePath(url.database or "memory").stem or "memory"
    return url.database or url.host or "default"


def _names(member: Member, depth: int) -> str:
    url = member.outbox.url
    schema = member.schema
    if depth == 0 and schema is not None:
        return schema
    if depth <= 1:
        base = _database_name(url)
        return base if schema is None or depth == 0 else f"{base}.{schema}"
    place = f"{url.host or ''}{':' + str(url.port) if url.port else ''}"
    full = f"{place}/{_database_name(url)}"
    return full if schema is None else f"{full}.{schema}"


def label(members: list[Member]) -> list[Member]:
    """Give each member a unique label: its schema (else its database), qualified by more
    of its URL only where two would share one."""
    depth = {id(m): 0 for m in members}
    for _ in range(3):
        seen: dict[str, int] = {}
        for m in members:
            name = _names(m, depth[id(m)])
            seen[name] = seen.get(name, 0) + 1
        clashing = [m for m in members if seen[_names(m, depth[id(m)])] > 1]
        if not clashing:
            break
        for m in clashing:
            depth[id(m)] += 1
    final = [_names(m, depth[id(m)]) for m in members]
    counts = collections.Counter(final)
    for index, (m, name) in enumerate(zip(members, final, strict=True)):
        m.label = name if counts[name] == 1 else f"{name}#{index}"
    return members


def weight_of(label: str, weights: dict[str, int]) -> int:
    """The weight of the outbox ``label``: its pattern's in ``weights`` (the first that
    matches), else 1."""
    for pattern, weight in weights.items():
        if fnmatch.fnmatchcase(label, pattern):
            return weight
    return 1
