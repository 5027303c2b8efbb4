"""SQLAlchemy Core statements as SQL text and parameters for a DB-API cursor.

The toolkit builds every statement with SQLAlchemy Core; on a connection
SQLAlchemy does not manage, the statement is compiled with the driver's own
SQLAlchemy dialect (its paramstyle, quoting and casts) and its parameters
converted by the same type processors SQLAlchemy would apply, then handed to
the driver as they are.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.sql.compiler import SQLCompiler

#: Compiled statements kept per dialect (statements built once by the dialect
#: are reused on every enqueue; delayed events build one per call).
_CACHE_SIZE = 256


@dataclass(frozen=True)
class Prepared:
    """One statement compiled for one driver."""

    sql: str
    compiled: SQLCompiler
    processors: Mapping[str, Callable[[Any], Any]]

    def parameters(self, values: Mapping[str, Any]) -> Sequence[Any] | dict[str, Any]:
        """The driver's parameters for ``values`` (by position or by name, as it takes them)."""
        params = dict(self.compiled.construct_params(dict(values)))
        for name, process in self.processors.items():
            if name in params:
                params[name] = process(params[name])
        if self.compiled.positional:
            positions = self.compiled.positiontup or []
            return [params[name] for name in positions]
        return params


class StatementCompiler:
    """Compiles statements for one SQLAlchemy dialect, keeping the recent ones."""

    def __init__(self, dialect: sa.Dialect) -> None:
        self.dialect = dialect
        self._lock = threading.Lock()
        # Keyed by id(); the statement is held so its id is not reused while cached.
        self._cache: dict[int, tuple[sa.Executable, Prepared]] = {}

    def prepare(self, statement: sa.Executable) -> Prepared:
        """``statement`` compiled for this dialect (from the cache when seen recently)."""
        hit = self._cache.get(id(statement))
        if hit is not None and hit[0] is statement:
            return hit[1]
        prepared = self._compile(statement)
        with self._lock:
            if len(self._cache) >= _CACHE_SIZE:
                self._cache.clear()
            self._cache[id(statement)] = (statement, prepared)
        return prepared

    def _compile(self, statement: sa.Executable) -> Prepared:
        compiled = statement.compile(dialect=self.dialect)  # type: ignore[attr-defined]
        assert isinstance(compiled, SQLCompiler)
        if compiled.post_compile_params or compiled.literal_execute_params:
            # "IN (...)" lists and the like are rendered at execution by
            # SQLAlchemy's engine; the toolkit's enqueue statements have none.
            raise TypeError("statements with post-compile parameters are not supported here")
        escaped = compiled.escaped_bind_names
        processors: dict[str, Callable[[Any], Any]] = {}
        for name, bind in compiled.binds.items():
            process = bind.type.dialect_impl(self.dialect).bind_processor(self.dialect)
            if process is not None:
                processors[escaped.get(name, name)] = process
        return Prepared(compiled.string, compiled, processors)
