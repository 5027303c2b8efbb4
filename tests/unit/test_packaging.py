"""The wheel installs one import package, and works beside a project's own ``brokers``/``dialects``.

The repository keeps its top-level ``dialects/`` and ``brokers/`` folders; in
the wheel they are ``outbox_core.dialects`` and ``outbox_core.brokers``. The
editable install used for development cannot show a collision, so this builds
the wheel, installs it with pip into a fresh virtual environment, and runs a
user project that has packages named ``brokers`` and ``dialects`` of its own.
"""

from __future__ import annotations

import os
import re
import shutil
import site
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

USER_SCRIPT = """
import brokers, dialects  # the project's own packages
from outbox_core import Outbox
from outbox_core.brokers.memory import MemoryBroker, MemoryQueue

outbox = Outbox("sqlite:///app.db")
outbox.install()
with outbox.engine.begin() as conn:
    outbox.enqueue(conn, "order.created", {"order_id": 1}, key="order-1")
queue = MemoryQueue("app")
relay = outbox.relay(MemoryBroker(queue), ordered=True)
assert relay.run_once().sent == 1
relay.close()
assert [e.topic for e in queue.snapshot()] == ["order.created"]
assert brokers.MINE == "user brokers" and dialects.MINE == "user dialects"
import outbox_core
print(outbox_core.__file__)
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # Build from a copy of what git tracks: a stale build/ folder in the checkout
    # would otherwise add modules that no longer exist.
    tree = tmp_path_factory.mktemp("tree")
    tracked = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.split(b"\0")
    for name in filter(None, tracked):
        source, target = ROOT / name.decode(), tree / name.decode()
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            target.symlink_to(os.readlink(source))
        elif source.is_file():
            shutil.copy2(source, target)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         str(tree), "-w", str(out)],
        check=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    [built] = out.glob("outbox_toolkit-*.whl")
    return built


def test_the_wheel_has_one_top_level_import_package(wheel: Path) -> None:
    names = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert {n for n in names if not n.endswith(".dist-info")} == {"outbox_core"}
    files = zipfile.ZipFile(wheel).namelist()
    for module in (
        "dialects/postgresql/__init__.py",
        "dialects/mysql/doctor.py",
        "brokers/rabbitmq/connection.py",
        "doctor/checks.py",
        "verify/machine.py",
        "verify/crash.py",
        "verify/sink.py",
        "verify/matrix.py",
        "verify/checks.py",
        "verify/harness.py",
        "cli/__init__.py",
        "cli/__main__.py",
        "cli/options.py",
    ):
        assert f"outbox_core/{module}" in files
    assert "outbox_core/py.typed" in files


def test_the_verify_extra_brings_hypothesis_for_the_state_machine(wheel: Path) -> None:
    """``pip install 'outbox-toolkit[verify]'`` (README, docs/ci.md) installs what it needs."""
    with zipfile.ZipFile(wheel) as zf:
        [name] = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        metadata = zf.read(name).decode()
    assert "Provides-Extra: verify" in metadata
    assert any(
        line.startswith("Requires-Dist: hypothesis") and 'extra == "verify"' in line
        for line in metadata.splitlines()
    ), metadata
    # Without the extra nothing imports hypothesis: the core dependencies stay two.
    assert not any(
        line.startswith("Requires-Dist: hypothesis") and "extra ==" not in line
        for line in metadata.splitlines()
    )


def _venv_with(wheel: Path, venv: Path) -> Path:
    """A fresh venv with only the wheel installed; its site-packages."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
         "--no-index", str(wheel)],
        check=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    # The dependencies (SQLAlchemy, click, the drivers) come from this environment:
    # a plain path entry, so the development checkout's editable hook is not loaded there.
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    target = venv / "lib" / version / "site-packages"
    (target / "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return target


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """One fresh venv with the wheel, shared by the databases: (venv, its site-packages)."""
    venv = tmp_path_factory.mktemp("installed") / "venv"
    return venv, _venv_with(wheel, venv)


def test_the_installed_wheel_verifies_a_server_with_no_checkout(
    installed: tuple[Path, Path], tmp_path: Path, db_url: str
) -> None:
    """``outbox verify --quick`` from the wheel alone, run outside any checkout."""
    venv, target = installed
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    which = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import outbox_core; print(outbox_core.__file__)"],
        cwd=elsewhere, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert which.stdout.startswith(str(target)), which.stdout + which.stderr
    done = subprocess.run(
        [str(venv / "bin" / "outbox"), "verify", "--db", db_url, "--quick"],
        cwd=elsewhere, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert " 0 failed" in done.stdout
    # Every guarantee ran, the SIGKILL run with real relay processes among them...
    assert "PASS  state-machine" in done.stdout
    assert "SIGKILLs" in done.stdout or "SKIP  sigkill" in done.stdout
    # ...and none of those processes outlived it.
    assert not verify_relays(), "relay processes of the SIGKILL run were left running"


def verify_relays() -> list[int]:
    """Pids of ``outbox relay`` processes started by a verify SIGKILL run (Linux /proc)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes()
            environ = (proc / "environ").read_bytes()
        except OSError:
            continue
        if b"outbox_core.cli\0relay" in cmdline and b"/outbox-verify-" in environ:
            found.append(int(proc.name))
    return found


def test_a_project_with_its_own_brokers_and_dialects_packages_works(
    wheel: Path, tmp_path: Path
) -> None:
    venv = tmp_path / "venv"
    target = _venv_with(wheel, venv)
    python = venv / "bin" / "python"
    project = tmp_path / "project"
    for name in ("brokers", "dialects"):
        (project / name).mkdir(parents=True)
        (project / name / "__init__.py").write_text(f'MINE = "user {name}"\n')
        (project / name / "base.py").write_text("# the project's own module\n")
    (project / "app.py").write_text(textwrap.dedent(USER_SCRIPT))
    result = subprocess.run(
        [str(python), "app.py"], cwd=project, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert str(target) in result.stdout, "outbox_core did not come from the installed wheel"
    cli = subprocess.run(
        [str(venv / "bin" / "outbox"), "schema", "--dialect", "postgresql"],
        cwd=project, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert cli.returncode == 0, cli.stderr
    assert re.search(r"CREATE TABLE outbox", cli.stdout)
