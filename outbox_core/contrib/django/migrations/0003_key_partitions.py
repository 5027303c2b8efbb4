"""Key partitions: the outbox's ``key_partition`` column and the relay membership table.

As ``outbox install`` does on tables an earlier version created: the column
is added (rows already there keep NULL, which relays read as "compute it
from the key"), the membership table is created.
"""

from __future__ import annotations

from typing import Any

from django.db import migrations, models

from outbox_core.contrib.django import schema
from outbox_core.contrib.django.conf import outbox_settings

TABLE = outbox_settings().table


def install(apps: Any, schema_editor: Any) -> None:
    schema.install(schema_editor.connection, TABLE, schema_editor.execute)


class Migration(migrations.Migration):
    dependencies = [("outbox_toolkit", "0002_sqlite_wal")]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[
                # Not atomic: MySQL and MariaDB cannot roll DDL back (see 0004).
                migrations.RunPython(
                    install,
                    migrations.RunPython.noop,
                    atomic=False,
                    hints={"model_name": "outboxevent"},
                ),
            ],
            state_operations=[
                migrations.AddField(
                    model_name="outboxevent",
                    name="key_partition",
                    field=models.SmallIntegerField(blank=True, null=True),
                ),
            ],
        ),
    ]
