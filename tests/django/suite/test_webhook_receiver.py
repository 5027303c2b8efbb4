"""The Django webhook receiver's tests, run by Django's own test runner on this run's database.

``tests/django/project/webhook_tests.py`` tests ``docs/examples/consumers/webhook_django.py``
(Django's test client, then the toolkit's webhook relay POSTing to the live
test server); ``python manage.py test`` runs it here with test databases of
its own (a suffix per Django version: the 4.2 and 5.x runs may overlap).
"""

from __future__ import annotations

import django

from tests.django.suite.conftest import manage


def test_manage_py_test_runs_the_webhook_receiver_tests() -> None:
    suffix = f"_webhooks{django.VERSION[0]}"
    result = manage(
        "test",
        "tests.django.project.webhook_tests",
        "--noinput",
        env={"OBX_DJANGO_TEST_SUFFIX": suffix},
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-6000:]
    assert "Ran 6 tests" in result.stderr, result.stderr[-6000:]
