"""Every example of the README and the documentation site runs, as the page shows it.

Each page's ```python blocks run in order in one namespace (Sybil), in a fresh
working directory, against this machine's services: the examples use the
addresses a reader's own local servers would have (PostgreSQL's ``postgres``
database, RabbitMQ's guest user). Setup a reader need not see sits in
``<!-- invisible-code-block: python -->`` comments. A block preceded by
``<!-- skip: next "reason" -->`` is not run; tests/unit/test_docs_site.py holds
every skip to a reason. A block that only includes a file (``--8<-- "path"``)
shows code that a test under tests/ runs: that test must name the path.

On the pages of ``SHELL_PAGES`` (the tutorial) the ```bash blocks run too, in
the same directory and in page order, with the environment's ``outbox``
first on PATH. Elsewhere each ``outbox`` command line of a shell block is
parsed by the real CLI (tests/unit/test_docs_site.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import tempfile
import unittest
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sybil import Example, Sybil
from sybil.evaluators.python import PythonEvaluator
from sybil.parsers.markdown import CodeBlockParser, SkipParser

from tests.docs_pages import DOCS, PAGES, ROOT, blocks

pytestmark = pytest.mark.needs_server

#: Pages whose shell blocks are run, not only parsed.
SHELL_PAGES = {DOCS / "tutorial.md"}

_python = PythonEvaluator(future_imports=())


def _tests_naming(path: str) -> list[Path]:
    return [
        test
        for test in (ROOT / "tests").rglob("*.py")
        if test.name != Path(__file__).name and path in test.read_text(encoding="utf-8")
    ]


def _evaluate_python(example: Example) -> Any:
    source = str(example.parsed).strip()
    if source.startswith("--8<--"):
        path = source.split('"')[1]
        assert (ROOT / path).is_file(), f"{example.path}: included file {path} is missing"
        assert _tests_naming(path), f"{example.path}: no test under tests/ runs {path}"
        return None
    return _python(example)


def _evaluate_shell(example: Example) -> Any:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", str(example.parsed)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    print(result.stdout, result.stderr, sep="\n")
    assert result.returncode == 0, (
        f"{example.path}:{example.line}: exit {result.returncode}\n"
        f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )
    return None


def _sybil(page: Path) -> Sybil:
    parsers: list[Any] = [CodeBlockParser("python", _evaluate_python), SkipParser()]
    if page in SHELL_PAGES:
        parsers.append(CodeBlockParser("bash", _evaluate_shell))
    return Sybil(parsers=parsers)


@contextlib.contextmanager
def _one_page_at_a_time() -> Iterator[None]:
    """The examples share names (the ``outbox`` table, the ``billing`` queue): one page at once."""
    with open(Path(tempfile.gettempdir()) / "outbox-docs-examples.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


RUNNABLE = [page for page in PAGES if any(b.language in ("python", "bash") for b in blocks(page))]


@pytest.mark.parametrize("page", RUNNABLE, ids=[str(p.relative_to(ROOT)) for p in RUNNABLE])
def test_page_examples_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    document = _sybil(page).parse(page)
    with _one_page_at_a_time():
        for example in document.examples():
            # A skipped block raises SkipTest for itself alone: the page goes on.
            with contextlib.suppress(unittest.SkipTest):
                example.evaluate()
