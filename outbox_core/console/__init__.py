"""The outbox dashboard: what waits, what flows, which relays run, and replays of dead events.

``outbox dashboard --db URL`` serves it; :func:`console_app` mounts it in an
ASGI application (FastAPI, Starlette, Django's ASGI), :func:`console_wsgi` in
a WSGI one; :func:`fleet_console_app` serves many outboxes (``--db``
repeated, ``--schemas``). Needs the ``dashboard`` extra (``pip install
'outbox-toolkit[dashboard]'``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from outbox_core.console.app import console_app
from outbox_core.console.fleet import fleet_console_app
from outbox_core.console.security import TOKEN_ENV, load_token

if TYPE_CHECKING:
    from outbox_core.outbox import Outbox


def console_wsgi(outbox: Outbox, **options: Any) -> Any:
    """The dashboard as a WSGI application (same options as :func:`console_app`)."""
    from a2wsgi import ASGIMiddleware

    return ASGIMiddleware(console_app(outbox, **options))  # type: ignore[arg-type]


__all__ = ["TOKEN_ENV", "console_app", "console_wsgi", "fleet_console_app", "load_token"]
