"""The Django suite runs under pytest-django with one settings module per database.

``tests/django/suite`` is collected only when Django is configured
(``--ds`` or ``DJANGO_SETTINGS_MODULE``); the plain ``python -m pytest``
run reaches it through ``test_databases.py``, which runs it once per
database in a pytest process of its own (Django's settings are per process).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def django_configured(config: pytest.Config) -> bool:
    return bool(config.getoption("ds", None) or os.environ.get("DJANGO_SETTINGS_MODULE"))


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if collection_path.name == "suite" and not django_configured(config):
        return True
    return None
