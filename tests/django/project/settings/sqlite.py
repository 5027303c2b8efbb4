"""SQLite: a file (the relay runs in another process); its test database a file too."""

import tempfile
from pathlib import Path

from tests.django.project.settings.base import *  # noqa: F403
from tests.django.project.settings.base import DB_NAME, TEST_SUFFIX, other_database

_dir = Path(tempfile.gettempdir())
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": DB_NAME or str(_dir / "obx_django_dev.sqlite3"),
        "TEST": {"NAME": str(_dir / f"obx_django_test{TEST_SUFFIX}.sqlite3")},
    },
    "other": other_database("sqlite"),
}
