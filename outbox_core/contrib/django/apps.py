"""The Django app of the outbox: ``INSTALLED_APPS = [..., "outbox_core.contrib.django"]``."""

from __future__ import annotations

from django.apps import AppConfig


class OutboxConfig(AppConfig):
    """Migrations for the outbox and inbox tables, the admin, the ``outbox`` command, checks."""

    name = "outbox_core.contrib.django"
    #: Not "outbox": a project may have its own app of that name (a hand-made outbox).
    label = "outbox_toolkit"
    verbose_name = "Outbox"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        """Register the system checks."""
        from outbox_core.contrib.django import checks  # noqa: F401  (registers the checks)
