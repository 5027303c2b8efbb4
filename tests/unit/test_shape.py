"""The code's shape: modules keep to their own state and size, and the relay knows no database.

What these check is what a reader relies on: a module's private names are
its own (nothing imports them, nothing reaches into another object's
``_attributes``), ``outbox_core.relay`` reaches databases only through the
dialect and log-source interfaces, and no module or function grows past
what one reading holds.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = [ROOT / "outbox_core", ROOT / "dialects", ROOT / "brokers"]
#: Lines per module and per function: what one reading holds.
MODULE_LINES = 500
FUNCTION_LINES = 80
#: Underscore names that are other libraries' public API.
FOREIGN_PUBLIC = {"KafkaError": "librdkafka's error codes are _NAMES", "parts": "namedtuple"}


def modules() -> Iterator[Path]:
    for package in PACKAGES:
        for path in sorted(package.rglob("*.py")):
            # outbox_core/dialects and outbox_core/brokers are links to the top-level folders.
            if path.is_relative_to(ROOT / "outbox_core") and path.relative_to(
                ROOT / "outbox_core"
            ).parts[0] in ("dialects", "brokers"):
                continue
            yield path


def tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_module_imports_another_modules_private_names() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{node.lineno} imports {alias.name} from {node.module}"
        for path in modules()
        for node in ast.walk(tree(path))
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
        if private(alias.name)
    ]
    assert not found, "\n".join(found)


def test_no_code_reaches_into_another_objects_private_attributes() -> None:
    found = []
    for path in modules():
        for node in ast.walk(tree(path)):
            if not (isinstance(node, ast.Attribute) and private(node.attr)):
                continue
            owner = node.value
            if isinstance(owner, ast.Name) and (
                owner.id in ("self", "cls") or owner.id in FOREIGN_PUBLIC
            ):
                continue
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    assert not found, "\n".join(found)


def test_all_lists_only_public_names() -> None:
    found = []
    for path in modules():
        for node in tree(path).body:
            if (
                isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
                and isinstance(node.value, ast.List | ast.Tuple)
            ):
                names = [e.value for e in node.value.elts if isinstance(e, ast.Constant)]
                found += [f"{path.relative_to(ROOT)}: {n}" for n in names if private(str(n))]
    assert not found, "\n".join(found)


def test_the_relay_imports_no_databases_package() -> None:
    families = [p.name for p in (ROOT / "dialects").iterdir() if p.is_dir() and p.name != "base"]
    found = []
    for path in sorted((ROOT / "outbox_core" / "relay").rglob("*.py")):
        for node in ast.walk(tree(path)):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            for name in names:
                if any(name.startswith(f"outbox_core.dialects.{f}") for f in families):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name}")
    assert not found, "\n".join(found)


@pytest.mark.parametrize("path", list(modules()), ids=lambda p: str(p.relative_to(ROOT)))
def test_modules_and_functions_stay_readable(path: Path) -> None:
    lines = path.read_text(encoding="utf-8").count("\n")
    assert lines <= MODULE_LINES, f"{lines} lines: split it along a seam"
    long = [
        f"{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for node in ast.walk(tree(path))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > FUNCTION_LINES
    ]
    assert not long, ", ".join(long)
