"""The documentation site: it builds in strict mode, its reference is complete, its
commands parse, and neither it nor the README carries development history."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import pytest

from outbox_core.cli import main
from outbox_core.config import Settings
from tests.docs_pages import (
    DOCS,
    PAGES,
    ROOT,
    blocks,
    shell_commands,
    skip_directives_without_reason,
)


def _load_hook() -> Any:
    """docs/hooks/reference.py, the MkDocs hook that generates the reference tables."""
    spec = importlib.util.spec_from_file_location("docs_reference", DOCS / "hooks" / "reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


reference = _load_hook()


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``mkdocs build --strict``: a broken link or anchor, or a page out of the nav, fails."""
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-6000:]
    return out


def _page(site: Path, name: str) -> str:
    return (site / name / "index.html").read_text(encoding="utf-8")


def test_the_site_builds_in_strict_mode(site: Path) -> None:
    assert (site / "index.html").is_file()
    assert (site / "tutorial" / "index.html").is_file()


def test_the_cli_reference_shows_every_command_and_option(site: Path) -> None:
    html = _page(site, "reference/cli")
    for name, command in main.commands.items():
        assert f'id="outbox-{name}"' in html, f"outbox {name} is missing"
        for param in command.params:
            if isinstance(param, click.Option) and not param.hidden:
                for opt in param.opts:
                    assert opt in html, f"outbox {name} {opt} is missing"


def test_the_settings_reference_shows_every_field_with_its_variable(site: Path) -> None:
    html = _page(site, "reference/settings")
    described = reference.field_comments(Settings)
    for field in dataclasses.fields(Settings):
        assert f"<code>{field.name}</code>" in html
        assert f"<code>OUTBOX_{field.name.upper()}</code>" in html
        assert described.get(field.name), f"Settings.{field.name} has no #: description"


def test_the_broker_reference_describes_every_option(site: Path) -> None:
    html = _page(site, "reference/brokers")
    for title, _, target in reference.BROKERS:
        assert title in html
        cls = reference._load(target)
        described = reference.field_comments(cls)
        for field in dataclasses.fields(cls):
            assert f"<code>{field.name}</code>" in html
            assert described.get(field.name), f"{cls.__name__}.{field.name} has no description"


def test_the_metrics_reference_lists_what_a_relay_exports(site: Path) -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    from outbox_core.metrics import RelayMetrics

    registry = prometheus_client.CollectorRegistry()
    RelayMetrics(registry=registry)
    exported = {m.name + ("_total" if m.type == "counter" else "") for m in registry.collect()}
    documented = {m.name for m in reference.metrics()}
    assert exported <= documented, exported - documented
    html = _page(site, "reference/metrics")
    for name in documented:
        assert f"<code>{name}</code>" in html


def test_the_api_reference_is_generated_from_docstrings(site: Path) -> None:
    html = _page(site, "reference/api")
    for name in (
        "outbox.Outbox.enqueue",
        "outbox.Outbox.enqueue_many",
        "inbox.Inbox.record",
        "relay.facade.Relay.run_once",
    ):
        assert f'id="outbox_core.{name}"' in html, name


HISTORY = re.compile(
    r"\bissue #?\d+|\bearlier release|\bprevious release|\bI (have|had|measured|found|tried)\b"
    r"|\blast session\b|\(before: ",
    re.I,
)


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_no_development_history(page: Path) -> None:
    found = [
        f"{n}: {line.strip()}"
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
        if HISTORY.search(line)
    ]
    assert not found, "\n".join(found)


def test_the_readme_is_a_front_page() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, len(lines)


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_skipped_example_says_why(page: Path) -> None:
    assert not skip_directives_without_reason(page)


def _parse(words: list[str]) -> None:
    """Parse ``outbox ...`` with the real CLI, without running it."""
    try:
        ctx = main.make_context("outbox", words[1:])
        args = [*ctx._protected_args, *ctx.args]
        if not args:
            return
        name, command, rest = main.resolve_command(ctx, args)
        assert command is not None and name is not None
        command.make_context(name, rest, parent=ctx)
    except click.exceptions.Exit:  # --help, --version
        return


COMMANDS = [
    (block, words)
    for page in PAGES
    for block in blocks(page)
    if block.language in ("bash", "sh", "console", "")
    for words in shell_commands(block.text)
    if words[0] == "outbox"
]


def test_the_pages_show_commands() -> None:
    assert len(COMMANDS) > 20


@pytest.mark.parametrize(
    ("block", "words"), COMMANDS, ids=[f"{b.where}:{' '.join(w[:2])}" for b, w in COMMANDS]
)
def test_every_documented_command_parses(block: object, words: list[str]) -> None:
    try:
        _parse(words)
    except click.ClickException as exc:
        pytest.fail(f"{' '.join(words)}: {exc.format_message()}")


def test_the_changelog_says_what_this_version_changed() -> None:
    """Keep a Changelog: the version pyproject.toml declares has a section of its own."""
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert version is not None
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert "## [Unreleased]" in changelog
    section = re.search(
        rf"^## \[{re.escape(version.group(1))}\] - \d{{4}}-\d{{2}}-\d{{2}}\n(.*?)(?=^## \[)",
        changelog,
        re.S | re.M,
    )
    assert section, f"CHANGELOG.md has no section for {version.group(1)}"
    assert re.search(
        r"^### (Added|Changed|Fixed|Removed|Deprecated|Security)", section.group(1), re.M
    )
