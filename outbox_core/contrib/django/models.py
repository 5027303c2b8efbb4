"""The outbox and inbox tables as Django models (the admin reads them).

The tables are created by the app's migration with the toolkit's own DDL,
not Django's; the models are managed only so that Django's ``flush`` (and
so ``TransactionTestCase``) empties them. Write events with ``outbox.enqueue``,
never through these models.
"""

from __future__ import annotations

from typing import Any

from django.db import models

from outbox_core.contrib.django.conf import outbox_settings
from outbox_core.message import State

TABLE = outbox_settings().table

STATE_CHOICES = [(int(s), s.name.lower()) for s in State]


class EventIdField(models.CharField):  # type: ignore[type-arg]
    """An event id as its 36-character string on every database.

    The column is ``uuid`` on PostgreSQL (its drivers return ``UUID``) and
    ``CHAR(36)`` elsewhere; ``enqueue`` returns strings, so the model does too.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("max_length", 36)
        super().__init__(*args, **kwargs)

    def from_db_value(self, value: Any, expression: Any, connection: Any) -> str | None:
        """The driver's value (``UUID`` on PostgreSQL) as its string."""
        return None if value is None else str(value)


class OutboxEvent(models.Model):
    """A row of the outbox table."""

    id: models.BigAutoField[Any, Any] = models.BigAutoField(primary_key=True)
    event_id = EventIdField(unique=True)
    topic: models.CharField[Any, Any] = models.CharField(max_length=255)
    key: models.CharField[Any, Any] = models.CharField(max_length=255, null=True, blank=True)
    key_partition: models.SmallIntegerField[Any, Any] = models.SmallIntegerField(
        null=True, blank=True
    )
    payload: models.JSONField[Any, Any] = models.JSONField()
    headers: models.JSONField[Any, Any] = models.JSONField(null=True, blank=True)
    state: models.SmallIntegerField[Any, Any] = models.SmallIntegerField(
        choices=STATE_CHOICES, default=0
    )
    attempts: models.IntegerField[Any, Any] = models.IntegerField(default=0)
    available_at: models.DateTimeField[Any, Any] = models.DateTimeField()
    lease_owner: models.CharField[Any, Any] = models.CharField(max_length=64, null=True, blank=True)
    lease_until: models.DateTimeField[Any, Any] = models.DateTimeField(null=True, blank=True)
    created_at: models.DateTimeField[Any, Any] = models.DateTimeField()
    sent_at: models.DateTimeField[Any, Any] = models.DateTimeField(null=True, blank=True)
    last_error: models.TextField[Any, Any] = models.TextField(null=True, blank=True)

    class Meta:
        """The table of ``settings.OUTBOX["TABLE"]``."""

        db_table = TABLE
        verbose_name = "outbox event"
        ordering = ("-id",)

    def __str__(self) -> str:
        return f"{self.topic} {self.event_id}"


class InboxRecord(models.Model):
    """A row of the inbox table: ``consumer`` processed ``event_id``.

    The table's key is ``(consumer, event_id)``; the model names ``event_id``
    its primary key for Django (which had no composite keys before 5.2),
    so look rows up by both fields.
    """

    consumer: models.CharField[Any, Any] = models.CharField(max_length=128)
    event_id = EventIdField(primary_key=True)
    processed_at: models.DateTimeField[Any, Any] = models.DateTimeField()

    class Meta:
        """``<table>_inbox``."""

        db_table = f"{TABLE}_inbox"
        verbose_name = "inbox record"
        ordering = ("-processed_at",)

    def __str__(self) -> str:
        return f"{self.consumer} {self.event_id}"
