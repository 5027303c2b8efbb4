"""The README and the documentation pages, and the code blocks they hold.

Shared by the tests that run the pages' examples (tests/contract/test_docs_examples.py)
and the tests that check the site and the commands it shows (tests/unit/test_docs_site.py).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

#: Every page: the README and the site's Markdown.
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]

_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)
_SKIP = re.compile(r"<!--+\s*skip:\s*next(.*?)-->")


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page."""

    page: Path
    line: int
    language: str
    text: str
    skipped: bool

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> Iterator[Block]:
    """The fenced blocks of ``page``, each with whether a skip directive precedes it."""
    text = page.read_text(encoding="utf-8")
    for match in _FENCE.finditer(text):
        before = text[: match.start()].rstrip()
        skipped = bool(_SKIP.search(before.rsplit("\n", 1)[-1]))
        line = text.count("\n", 0, match.start()) + 1
        yield Block(page, line, match.group(1), match.group(2), skipped)


def skip_directives_without_reason(page: Path) -> list[str]:
    """Skip directives on ``page`` that give no quoted reason."""
    text = page.read_text(encoding="utf-8")
    return [m.group(0) for m in _SKIP.finditer(text) if not re.search(r'"[^"]+"', m.group(1))]


def shell_commands(text: str) -> Iterator[list[str]]:
    """Each simple command of a shell block, as words (continuations joined, comments dropped).

    Heredoc bodies are left out; environment assignments before a command are dropped.
    """
    lines: list[str] = []
    heredoc: str | None = None
    for raw in text.replace("\\\n", " ").splitlines():
        if heredoc is not None:
            if raw.strip() == heredoc:
                heredoc = None
            continue
        marker = re.search(r"<<-?\s*['\"]?(\w+)['\"]?", raw)
        if marker:
            heredoc = marker.group(1)
            raw = raw[: marker.start()]
        lines.append(raw)
    for line in lines:
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        lexer.commenters = "#"
        try:
            words = [*lexer, ";"]
        except ValueError:  # an unclosed quote: the parse test shows the words as they are
            words = [*line.split(), ";"]
        command: list[str] = []
        for word in words:
            if word in (";", "&&", "||", "|", "&", ">", ">>", "<"):
                if command:
                    yield command
                command = []
                continue
            if not command and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", word):
                continue
            command.append(word)
