"""MariaDB through Django's mysql backend over mysqlclient (the ``mysqlclient`` extra:
it builds from source against libmariadb-dev; tests/django/test_suites.py runs these
settings only where it is installed, and .ci/run installs it after the README's commands)."""

import os

import MySQLdb  # noqa: F401 - Django's driver: its absence must fail, not fall back

from tests.django.project.settings.base import *  # noqa: F403
from tests.django.project.settings.base import DB_NAME, TEST_SUFFIX, other_database

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.mysql",
        "NAME": DB_NAME or "test",
        "USER": "root",
        "PASSWORD": os.environ.get("OBX_DJANGO_MYSQL_PASSWORD", ""),
        "HOST": "127.0.0.1",
        "PORT": "3306",
        "OPTIONS": {"charset": "utf8mb4"},
        "TEST": {"NAME": f"obx_django_mysql{TEST_SUFFIX}", "CHARSET": "utf8mb4"},
    },
    "other": other_database("mysql"),
}
