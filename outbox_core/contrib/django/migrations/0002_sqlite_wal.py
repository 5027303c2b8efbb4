"""SQLite: switch a file database to WAL, as ``outbox install`` does (outside a transaction)."""

from __future__ import annotations

from typing import Any

from django.db import migrations


def wal(apps: Any, schema_editor: Any) -> None:
    connection = schema_editor.connection
    if connection.vendor != "sqlite" or connection.is_in_memory_db():
        return
    with connection.cursor() as cursor:
        # Persistent: readers go on while a claim or a producer writes.
        cursor.execute("PRAGMA journal_mode=WAL")


class Migration(migrations.Migration):
    atomic = False  # journal_mode cannot change inside a transaction
    dependencies = [("outbox_toolkit", "0001_initial")]

    operations = [
        migrations.RunPython(wal, migrations.RunPython.noop, hints={"model_name": "outboxevent"}),
    ]
