"""PostgreSQL with psycopg2: psycopg 3 hidden, so Django's backend takes psycopg2.

Django's postgresql backend uses psycopg 3 whenever it can import it; the
test environment has both, so this module makes ``import psycopg`` fail in
this process (and in the ``manage.py`` processes the tests start with it).
"""

import sys

sys.modules["psycopg"] = None  # type: ignore[assignment]

from tests.django.project.settings.base import TEST_SUFFIX, other_database  # noqa: E402
from tests.django.project.settings.postgresql import *  # noqa: E402, F403
from tests.django.project.settings.postgresql import DATABASES  # noqa: E402

DATABASES["default"]["TEST"] = {"NAME": f"obx_django_pg2{TEST_SUFFIX}"}
DATABASES["other"] = other_database("pg2")
