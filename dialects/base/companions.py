"""A database family's companion modules, found beside its dialect: ``provision`` and ``doctor``.

Each family package may hold a ``provision`` module (where the test suites
find a server) and a ``doctor`` module (its own ``outbox doctor`` checks).
They register by being there: a dialect shipped by another package brings
its own the same way, and a family without one gets the defaults.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from outbox_core.dialects.base.dialect import Dialect


def companion(dialect: type[Dialect], leaf: str) -> ModuleType | None:
    """The module ``leaf`` of the package that holds ``dialect`` (None: it has none)."""
    package = sys.modules[dialect.__module__].__package__ or ""
    name = f"{package}.{leaf}" if package else leaf
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise  # the module exists but imports something missing: say so
        return None
