"""Django system checks of the outbox's settings and database routing."""

from __future__ import annotations

from typing import Any

from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.db import router


@checks.register(checks.Tags.database, deploy=False)
def check_outbox_database(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """``settings.OUTBOX`` is valid, and routers send the outbox where it says.

    A router that routes the outbox model to another database than
    ``settings.OUTBOX["DATABASE"]`` would make ``enqueue`` write to one
    database while ``manage.py outbox relay`` reads the other.
    """
    from outbox_core.contrib.django.api import routed_alias
    from outbox_core.contrib.django.conf import outbox_settings
    from outbox_core.contrib.django.models import OutboxEvent

    try:
        conf = outbox_settings()
    except ImproperlyConfigured as exc:
        return [checks.Error(str(exc), id="outbox.E001")]
    found: list[checks.CheckMessage] = []
    routed = routed_alias()
    if conf.database is not None and routed is not None and routed != conf.database:
        found.append(
            checks.Error(
                f"a database router sends the outbox to {routed!r}, but "
                f"settings.OUTBOX['DATABASE'] is {conf.database!r}: events would be written "
                f"to {routed!r} while `manage.py outbox relay` reads {conf.database!r}",
                hint="route the outbox_toolkit app to the same database in both places",
                obj=OutboxEvent,
                id="outbox.E002",
            )
        )
    alias = routed or conf.database
    if alias is not None and not router.allow_migrate(
        alias, "outbox_toolkit", model_name="outboxevent"
    ):
        found.append(
            checks.Warning(
                f"database routers do not allow the outbox_toolkit app to migrate on {alias!r}, "
                "where the outbox is: `manage.py migrate` will not create its tables there",
                hint="let allow_migrate return True for the app 'outbox_toolkit' on that database",
                obj=OutboxEvent,
                id="outbox.W001",
            )
        )
    return found
