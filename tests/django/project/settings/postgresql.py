"""PostgreSQL with psycopg 3 (Django picks psycopg 3 when it is installed)."""

import os

from tests.django.project.settings.base import *  # noqa: F403
from tests.django.project.settings.base import DB_NAME, TEST_SUFFIX, other_database

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": DB_NAME or "test",
        "USER": os.environ.get("OBX_DJANGO_PG_USER", "postgres"),
        "PASSWORD": os.environ.get("OBX_DJANGO_PG_PASSWORD", ""),
        "HOST": "127.0.0.1",
        "PORT": "5432",
        "TEST": {"NAME": f"obx_django_pg3{TEST_SUFFIX}"},
    },
    "other": other_database("pg3"),
}
