"""Pieces shared by the ``outbox`` commands (kept apart so command modules import no cycle)."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from outbox_core.config import redact
from outbox_core.errors import OutboxError

F = TypeVar("F", bound=Callable[..., Any])

#: Values of ``--dialect``.
DIALECT_NAMES = ["postgresql", "mysql", "mssql", "sqlite"]


def handle_errors(func: F) -> F:
    """Print toolkit errors as one clear line (exit 2) instead of a traceback."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except OutboxError as exc:
            click.echo(f"error: {redact(str(exc))}", err=True)
            sys.exit(2)

    return wrapper  # type: ignore[return-value]
