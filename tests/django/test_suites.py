"""Run the Django suite (tests/django/suite) per database and Django version, each in its pytest.

Django's settings, its database backends and psycopg's module are per
process, so each database gets a ``python -m pytest --ds=...`` of its own;
this is what the README's ``python -m pytest`` runs. The development
install has the newest Django 5.x; Django 4.2 LTS runs from a throwaway
virtual environment that holds only Django 4.2 and reaches everything else
through the development environment's site-packages (about 15 s to build).
A database server that is down skips its run, or fails it under ``CI=true``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

from tests.conftest import _probe, require_optional_driver, server_url, unavailable
from tests.contract.broker_fixtures import require_rabbitmq

ROOT = Path(__file__).resolve().parents[2]
SUITE = Path(__file__).resolve().parent / "suite"

#: settings module -> the database family it needs.
FAMILY = {
    "sqlite": "sqlite",
    "postgresql": "postgresql",
    "postgresql_psycopg2": "postgresql",
    "mariadb": "mysql",
}
#: settings -> a driver it needs that builds from source (tests/conftest.py).
NEEDS_DRIVER = {"mariadb": "mysqlclient"}
#: (settings, Django): every database on Django 5.x; SQLite and PostgreSQL on 4.2 LTS.
RUNS = [(s, "5") for s in FAMILY] + [("sqlite", "4.2"), ("postgresql", "4.2")]
PARAMS = [
    pytest.param(
        s,
        d,
        id=f"{s}-django{d}",
        marks=[pytest.mark.optional_driver] if s in NEEDS_DRIVER else [],
    )
    for s, d in RUNS
]


@pytest.fixture(scope="session")
def django42_python(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A Python whose Django is 4.2 LTS, with the development environment's packages."""
    home = tmp_path_factory.mktemp("django42")
    venv.create(home, with_pip=True)
    python = str(home / "bin" / "python")
    pip = subprocess.run(
        [python, "-m", "pip", "install", "-q", "Django>=4.2,<4.3"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert pip.returncode == 0, pip.stdout + pip.stderr
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # Appended after the venv's own site-packages: its Django 4.2 comes first.
    dev = sysconfig.get_paths()["purelib"]
    (Path(purelib) / "obx_dev.pth").write_text(f"import site; site.addsitedir({dev!r})\n")
    return python


@pytest.mark.needs_server
@pytest.mark.parametrize(("settings", "django"), PARAMS)
def test_django_suite(
    settings: str, django: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if settings in NEEDS_DRIVER:
        require_optional_driver(NEEDS_DRIVER[settings])
    family = FAMILY[settings]
    if family != "sqlite":
        url = server_url(family, tmp_path)
        reason = _probe(url) if url else "no URL"
        if reason is not None:
            unavailable(family, reason)
    require_rabbitmq()
    python = sys.executable if django == "5" else request.getfixturevalue("django42_python")
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    env["OBX_DJANGO_EXPECT_VERSION"] = django
    # Test databases of this run's own: the same settings on two Django versions
    # run side by side (obx_django_pg3 created by one, dropped by the other).
    env["OBX_DJANGO_TEST_SUFFIX"] = f"_d{django.replace('.', '')}"
    result = subprocess.run(
        [
            python,
            "-m",
            "pytest",
            str(SUITE),
            f"--ds=tests.django.project.settings.{settings}",
            "-p",
            "no:cacheprovider",
            # One process: the outer run's workers are the parallelism.
            "-n",
            "0",
            "-q",
            "--no-header",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert result.returncode == 0, f"{settings}:\n{result.stdout[-6000:]}\n{result.stderr[-3000:]}"
