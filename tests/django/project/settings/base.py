"""Settings shared by every database of the test project.

``OBX_DJANGO_DB_NAME`` names the database (the tests point a ``manage.py``
subprocess at Django's test database with it).
"""

import json
import os
import tempfile
from pathlib import Path

SECRET_KEY = "outbox-toolkit-tests"
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
ROOT_URLCONF = "tests.django.project.urls"
ALLOWED_HOSTS = ["*"]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "outbox_core.contrib.django",
    "tests.django.project.orders",
]

MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

OUTBOX = {
    "BROKER_URL": os.environ.get(
        "OUTBOX_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/%2F"
    ),
    "POLL_INTERVAL": "100ms",
}
# The broker's options (tests set them through the environment of manage.py).
_broker_options = json.loads(os.environ.get("OBX_DJANGO_BROKER_OPTIONS", "{}"))
if os.environ.get("OBX_DJANGO_WEBHOOK_SECRET"):
    # docs/django.md's idiom: a secret read from the environment, never on a command line.
    _broker_options["secret"] = os.environ["OBX_DJANGO_WEBHOOK_SECRET"]
if _broker_options:
    OUTBOX["BROKER_OPTIONS"] = _broker_options

DB_NAME = os.environ.get("OBX_DJANGO_DB_NAME")
#: Appended to the test databases' names (``manage.py test`` run from inside the suite).
TEST_SUFFIX = os.environ.get("OBX_DJANGO_TEST_SUFFIX", "")
_TMP = Path(tempfile.gettempdir())


def other_database(tag: str) -> dict[str, object]:
    """A second database (SQLite files) for the multi-database tests."""
    return {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("OBX_DJANGO_OTHER_NAME")
        or str(_TMP / f"obx_django_{tag}_other.sqlite3"),
        "TEST": {"NAME": str(_TMP / f"obx_django_{tag}_other_test{TEST_SUFFIX}.sqlite3")},
    }
