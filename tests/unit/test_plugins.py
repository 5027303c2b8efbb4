"""A broker and a dialect shipped by another package, found through entry points.

A tiny plug-in package (a ``pyproject.toml`` declaring entry points in the
groups ``outbox_core.brokers`` and ``outbox_core.dialects``) is pip-installed
into a temporary target directory, which is put on ``sys.path`` (in this
process) or ``PYTHONPATH`` (for the ``outbox`` command). Nothing touches the
test environment's site-packages.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from outbox_core import Outbox
from outbox_core.brokers import base as broker_registry
from outbox_core.brokers.base import create_broker, known_schemes, register_broker
from outbox_core.dialects.base import get_dialect, known_dialects
from outbox_core.dialects.base import registry as dialect_registry
from outbox_core.dialects.base.registry import register_dialect
from outbox_core.errors import BrokerError, ConfigurationError, UnknownBroker, UnknownDialect

PYPROJECT = """
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "outbox-tiny-plugin"
version = "0.1"

[project.entry-points."outbox_core.brokers"]
tiny = "tiny_outbox_plugin:TinyBroker"
tinybroken = "tiny_outbox_plugin:NotABroker"

[project.entry-points."outbox_core.dialects"]
tinysql = "tiny_outbox_plugin:TinyDialect"

[tool.setuptools]
py-modules = ["tiny_outbox_plugin"]
"""

MODULE = '''
"""A broker that appends each topic to the file named by its URL; SQLite renamed."""

from urllib.parse import urlsplit

from outbox_core.brokers.base import Broker
from outbox_core.dialects.sqlite import SqliteDialect
from outbox_core.message import Outcome


class TinyBroker(Broker):
    def __init__(self, path, prefix=""):
        self.path = path
        self.prefix = prefix

    @classmethod
    def from_url(cls, url, **options):
        return cls(urlsplit(url).path, **options)

    def publish(self, events):
        with open(self.path, "a", encoding="utf-8") as out:
            for event in events:
                out.write(self.prefix + event.topic + "\\n")
        return [Outcome.ok()] * len(events)


class NotABroker:
    pass


class TinyDialect(SqliteDialect):
    pass
'''


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The plug-in package built and pip-installed into a directory of its own."""
    source = tmp_path_factory.mktemp("tiny-plugin-src")
    (source / "pyproject.toml").write_text(PYPROJECT)
    (source / "tiny_outbox_plugin.py").write_text(MODULE)
    target = tmp_path_factory.mktemp("tiny-plugin-site")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-index",
            "--no-build-isolation",  # the test environment's setuptools; no network
            "--target",
            str(target),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert list(target.glob("outbox_tiny_plugin-0.1.dist-info/entry_points.txt"))
    return target


@pytest.fixture
def installed(plugin_dir: Path) -> Iterator[Path]:
    """The plug-in importable (and its metadata visible) in this process."""
    sys.path.insert(0, str(plugin_dir))
    importlib.invalidate_caches()
    try:
        yield plugin_dir
    finally:
        sys.path.remove(str(plugin_dir))
        sys.modules.pop("tiny_outbox_plugin", None)


def test_unknown_scheme_without_the_plugin() -> None:
    assert "tiny" not in known_schemes()
    with pytest.raises(UnknownBroker, match=r"entry-point group outbox_core\.brokers"):
        create_broker("tiny:///tmp/x")
    with pytest.raises(UnknownDialect, match=r"entry-point group outbox_core\.dialects"):
        get_dialect("tinysql")


def test_a_plugin_broker_is_created_by_its_url_scheme(installed: Path, tmp_path: Path) -> None:
    assert "tiny" in known_schemes()
    out = tmp_path / "out.txt"
    broker = create_broker(f"TINY://{out}", prefix="p-")
    assert type(broker).__name__ == "TinyBroker"
    assert broker.unavailable_errors == ()  # the base's default
    with pytest.raises(BrokerError, match=r"tinybroken:// broker .*is not a Broker subclass"):
        create_broker("tinybroken://x")


def test_a_plugin_dialect_is_found_by_its_backend_name(installed: Path) -> None:
    assert "tinysql" in known_dialects()
    assert get_dialect("tinysql").__name__ == "TinyDialect"


def test_a_dotted_path_is_the_fallback(installed: Path) -> None:
    assert get_dialect("tiny_outbox_plugin:TinyDialect").__name__ == "TinyDialect"
    register_broker("tinier", "tiny_outbox_plugin:TinyBroker")
    register_dialect("tinier", "tiny_outbox_plugin:TinyDialect")
    try:
        assert "tinier" in known_schemes() and "tinier" in known_dialects()
        assert type(create_broker("tinier:///dev/null")).__name__ == "TinyBroker"
        assert get_dialect("tinier").__name__ == "TinyDialect"
    finally:
        broker_registry.PLUGINS.registered.pop("tinier")
        dialect_registry.PLUGINS.registered.pop("tinier")
    with pytest.raises(ConfigurationError, match="built-in"):
        register_broker("amqp", "tiny_outbox_plugin:TinyBroker")
    with pytest.raises(UnknownDialect, match="cannot import"):
        get_dialect("no_such_module_here:Dialect")


def test_the_cli_relays_to_a_plugin_broker(plugin_dir: Path, tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'app.db'}"
    outbox = Outbox(db)
    outbox.install()
    with outbox.engine.begin() as conn:
        outbox.enqueue(conn, "order.created", {"id": 1})
    outbox.engine.dispose()
    out = tmp_path / "published.txt"
    env = os.environ.copy()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(plugin_dir), env.get("PYTHONPATH")]))
    command = ["relay", "--once", "--db", db, "--broker", f"tiny://{out}"]
    result = subprocess.run(
        [sys.executable, "-m", "outbox_core.cli", *command, "--broker-option", "prefix=cli-"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert out.read_text() == "cli-order.created\n"
