"""The outbox and inbox tables, with exactly the DDL and indexes ``outbox install`` creates.

The database side runs the toolkit's DDL for the server at hand
(:mod:`outbox_core.contrib.django.schema`); the state side describes the
models the admin reads. The table name is ``settings.OUTBOX["TABLE"]``.
"""

from __future__ import annotations

from typing import Any

from django.db import migrations, models

from outbox_core.contrib.django import schema
from outbox_core.contrib.django.conf import outbox_settings
from outbox_core.contrib.django.models import STATE_CHOICES, EventIdField

TABLE = outbox_settings().table


def install(apps: Any, schema_editor: Any) -> None:
    schema.install(schema_editor.connection, TABLE, schema_editor.execute)


def uninstall(apps: Any, schema_editor: Any) -> None:
    schema.uninstall(schema_editor.connection, TABLE, schema_editor.execute)


class Migration(migrations.Migration):
    initial = True
    dependencies = []

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[
                migrations.RunPython(install, uninstall, hints={"model_name": "outboxevent"}),
            ],
            state_operations=[
                migrations.CreateModel(
                    name="OutboxEvent",
                    fields=[
                        ("id", models.BigAutoField(primary_key=True, serialize=False)),
                        ("event_id", EventIdField(max_length=36, unique=True)),
                        ("topic", models.CharField(max_length=255)),
                        ("key", models.CharField(blank=True, max_length=255, null=True)),
                        ("payload", models.JSONField()),
                        ("headers", models.JSONField(blank=True, null=True)),
                        ("state", models.SmallIntegerField(choices=STATE_CHOICES, default=0)),
                        ("attempts", models.IntegerField(default=0)),
                        ("available_at", models.DateTimeField()),
                        ("lease_owner", models.CharField(blank=True, max_length=64, null=True)),
                        ("lease_until", models.DateTimeField(blank=True, null=True)),
                        ("created_at", models.DateTimeField()),
                        ("sent_at", models.DateTimeField(blank=True, null=True)),
                        ("last_error", models.TextField(blank=True, null=True)),
                    ],
                    options={
                        "verbose_name": "outbox event",
                        "db_table": TABLE,
                        "ordering": ("-id",),
                    },
                ),
                migrations.CreateModel(
                    name="InboxRecord",
                    fields=[
                        ("consumer", models.CharField(max_length=128)),
                        (
                            "event_id",
                            EventIdField(max_length=36, primary_key=True, serialize=False),
                        ),
                        ("processed_at", models.DateTimeField()),
                    ],
                    options={
                        "verbose_name": "inbox record",
                        "db_table": f"{TABLE}_inbox",
                        "ordering": ("-processed_at",),
                    },
                ),
            ],
        ),
    ]
