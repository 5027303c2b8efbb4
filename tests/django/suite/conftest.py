"""Fixtures of the Django suite: the database at hand, ``manage.py`` as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.conf import settings
from django.db import connections

from tests.django.project.settings.base import TEST_SUFFIX

MANAGE = Path(__file__).resolve().parents[1] / "project" / "manage.py"


@pytest.fixture
def vendor() -> str:
    return str(connections["default"].vendor)


def manage(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``python manage.py ARGS`` on Django's test database (the settings of this run)."""
    full_env = dict(os.environ)
    full_env["DJANGO_SETTINGS_MODULE"] = (
        os.environ.get("DJANGO_SETTINGS_MODULE") or settings.SETTINGS_MODULE
    )
    full_env["OBX_DJANGO_DB_NAME"] = str(connections["default"].settings_dict["NAME"])
    full_env["OBX_DJANGO_OTHER_NAME"] = str(connections["other"].settings_dict["NAME"])
    full_env.update(env or {})
    if env and "OBX_DJANGO_TEST_SUFFIX" in env:  # within this run's own (test_suites.py)
        full_env["OBX_DJANGO_TEST_SUFFIX"] = TEST_SUFFIX + env["OBX_DJANGO_TEST_SUFFIX"]
    return subprocess.run(
        [sys.executable, str(MANAGE), *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        check=False,
    )


@pytest.fixture
def admin_client_db(transactional_db: None, client, django_user_model) -> Iterator[object]:  # type: ignore[no-untyped-def]
    user = django_user_model.objects.create_superuser("admin", "admin@example.com", "pw")
    client.force_login(user)
    yield client


@pytest.fixture
def fresh_database(vendor: str, tmp_path: Path) -> Iterator[str]:
    """A new, empty database of the test server (a file on SQLite), dropped afterwards."""
    if vendor == "sqlite":
        yield str(tmp_path / "fresh.sqlite3")
        return
    name = f"obx_django_docs_{uuid.uuid4().hex[:8]}"
    with connections["default"].cursor() as cursor:
        cursor.execute(f"CREATE DATABASE {name}")
    try:
        yield name
    finally:
        with connections["default"].cursor() as cursor:
            cursor.execute(f"DROP DATABASE {name}")
