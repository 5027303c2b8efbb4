"""Private database servers a fault test may restart, kill and stop.

The machine's shared PostgreSQL and MariaDB are never restarted: a test that
needs a database to go away starts its own server on a free port, in a
temporary data directory, as an unprivileged user (``initdb`` refuses root;
``mariadbd`` is told ``--user=mysql``), and removes it afterwards.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

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


class PrivatePostgres:
    """A PostgreSQL cluster of the test's own: ``initdb``, ``pg_ctl`` on a free port.

    ``settings`` are extra server settings (``{"wal_level": "logical"}``),
    passed as ``-c key=value`` at every start; values without spaces.
    """

    user = "postgres"

    def __init__(self, settings: Mapping[str, str] | None = None) -> None:
        self.settings = dict(settings or {})
        bindir = Path(
            subprocess.run(
                ["pg_config", "--bindir"], capture_output=True, text=True, check=True
            ).stdout.strip()
        )
        if not (bindir / "initdb").exists():  # Debian: pg_config is the client's
            versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
            bindir = versions[-1].parent
        self.bin = bindir
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
    """A MariaDB server of the test's own: ``mariadb-install-db``, ``mariadbd --port``."""

    user = "mysql"

    def __init__(self) -> None:
        self.root = _private_dir("outbox-maria-", self.user)
        self.data = self.root / "data"
        self.socket = self.root / "mysqld.sock"
        self.port = free_port()
        self.log = self.root / "server.log"
        self.url = f"mysql+pymysql://root@127.0.0.1:{self.port}/test"
        subprocess.run(
            [
                "mariadb-install-db", "--no-defaults", f"--user={self.user}",
                f"--datadir={self.data}", "--auth-root-authentication-method=normal",
                "--skip-test-db",
            ],
            check=True, capture_output=True, timeout=180,
        )  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> float:
        """Start ``mariadbd``; seconds until it answers (the ``test`` database created)."""
        args = [
            "mariadbd", "--no-defaults", f"--datadir={self.data}", f"--port={self.port}",
            f"--socket={self.socket}", "--bind-address=127.0.0.1", f"--log-error={self.log}",
            f"--pid-file={self.root / 'mysqld.pid'}", "--skip-log-bin",
            "--innodb-buffer-pool-size=64M", "--innodb-flush-log-at-trx-commit=2",
            "--skip-name-resolve",
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


@contextmanager
def private_server(backend: str) -> Iterator[PrivatePostgres | PrivateMariaDB]:
    """A started private server of ``backend`` ("postgresql" or "mysql"), removed on exit."""
    server: PrivatePostgres | PrivateMariaDB = (
        PrivatePostgres() if backend == "postgresql" else PrivateMariaDB()
    )
    try:
        server.start()
        yield server
    finally:
        server.remove()
