"""The presence table: a row per running relay, whatever its mode.

As ``outbox install`` does on tables an earlier version created: the
``<table>_presence`` table is created where it is missing (a new database got
it from ``0001`` already). Relays run without it until then, saying so once.
"""

from __future__ import annotations

from typing import Any

from django.db import migrations

from outbox_core.contrib.django import schema
from outbox_core.contrib.django.conf import outbox_settings

TABLE = outbox_settings().table


def install(apps: Any, schema_editor: Any) -> None:
    schema.install(schema_editor.connection, TABLE, schema_editor.execute)


def uninstall(apps: Any, schema_editor: Any) -> None:
    schema.uninstall_presence(schema_editor.connection, TABLE, schema_editor.execute)


class Migration(migrations.Migration):
    dependencies = [("outbox_toolkit", "0003_key_partitions")]

    operations = [
        # Not atomic: MySQL and MariaDB cannot roll DDL back, and Django refuses
        # DDL inside the atomic block it would otherwise wrap RunPython in.
        migrations.RunPython(install, uninstall, atomic=False, hints={"model_name": "outboxevent"}),
    ]
