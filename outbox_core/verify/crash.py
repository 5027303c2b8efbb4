"""``sigkill``: real ``outbox relay`` processes killed with SIGKILL while they work.

Three ``outbox relay --ordered`` processes (one of them claiming runs of up to
three events per key) publish to :mod:`outbox_core.verify.sink` while a
producer commits events over a few keys, some of its transactions rolled
back. Every half second or so one relay that has published is killed with
SIGKILL, at whatever it was doing (claiming, publishing, settling), and
started again; the producer goes on until enough
kills landed on relays at work. When the
producer is done the kills stop and the relays drain the table. Then:

* every committed event was published (at least once);
* no rolled-back event was ever published;
* the first publication of each event follows commit order within its key;
* nothing went dead, and every row is ``sent``.

Killed relays publish some events again (at-least-once); the count is
reported, not judged.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa

from outbox_core.errors import UnsupportedDatabase
from outbox_core.message import State
from outbox_core.verify import sink
from outbox_core.verify.harness import Context, RollBack, expect
from outbox_core.verify.model import Failed, Skip

#: Lease of the relay processes: a killed relay's events come back this soon.
LEASE = "2s"
RELAYS = 3


@dataclass(frozen=True)
class Size:
    """How much a run does: events committed, over how many seconds, how many kills at least."""

    events: int
    seconds: float
    kills: int
    keys: int


#: The producer goes on past the run's events, for the kills, up to this many times them.
MORE_EVENTS = 10

SIZES = {
    "quick": Size(events=300, seconds=6, kills=4, keys=10),
    "default": Size(events=3000, seconds=20, kills=12, keys=30),
    "thorough": Size(events=20_000, seconds=90, kills=60, keys=200),
}


class _Relays:
    """``RELAYS`` relay processes; any of them can be killed and replaced."""

    def __init__(self, env: dict[str, str], workdir: Path, *, runs: bool) -> None:
        self.env, self.workdir, self.runs = env, workdir, runs
        self.started = 0
        self.log_of: dict[int, Path] = {}
        self.procs: list[subprocess.Popen[bytes]] = []
        try:
            for _ in range(RELAYS):
                self.procs.append(self._start())
        except BaseException:
            self.kill_all()
            raise
        self.up_since = [time.monotonic()] * RELAYS

    def _start(self) -> subprocess.Popen[bytes]:
        self.started += 1
        args = [sys.executable, "-m", "outbox_core.cli", "relay"]
        if self.runs and self.started % 3 == 0:
            args += ["--run-length", "3"]
        path = self.workdir / f"relay-{self.started}.log"
        with open(path, "wb") as log:
            proc = subprocess.Popen(args, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        self.log_of[proc.pid] = path
        return proc

    def kill_all(self) -> None:
        """SIGKILL every relay still running and reap it (an error path: nothing is judged)."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()

    def kill_one(self, rng: random.Random, working: set[int]) -> int | None:
        """SIGKILL a relay up for a second or more (past its imports), start another: its pid.

        Only one that has published (``working``: at work, holding partitions
        and batches), so the kills land mid-work; while none has, the fleet
        is left to recover (killing relays that never got to work, faster
        than their rows go stale, would keep every partition with a dead one).
        """
        now = time.monotonic()
        at_work = [
            i
            for i, t in enumerate(self.up_since)
            if now - t >= 1.0 and self.procs[i].pid in working
        ]
        if not at_work:
            return None
        index = rng.choice(at_work)
        victim = self.procs[index]
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=30)
        self.procs[index] = self._start()
        self.up_since[index] = time.monotonic()
        return victim.pid

    def failed(self) -> str | None:
        """The log of a relay that exited on its own (none should), else None."""
        for proc in self.procs:
            if proc.poll() is not None:
                return self._log_of(proc)
        return None

    def _log_of(self, proc: subprocess.Popen[bytes]) -> str:
        text = self.log_of[proc.pid].read_text(errors="replace").strip()
        return f"a relay process exited with {proc.returncode}: {text[-600:]}"

    def stop(self) -> list[str]:
        """SIGTERM every relay; the complaints of those that did not exit 0.

        A relay still importing Python when SIGTERM lands dies of it before
        its handler is set, so only relays up for a few seconds are judged.
        """
        judged = [time.monotonic() - t > 5.0 for t in self.up_since]
        for proc in self.procs:
            proc.send_signal(signal.SIGTERM)
        bad = []
        for proc, judge in zip(self.procs, judged, strict=True):
            try:
                code = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                bad.append("a relay did not stop within 60 s of SIGTERM")
                continue
            if judge and code != 0:
                bad.append(self._log_of(proc))
        return bad


def relays_survive_sigkill(ctx: Context) -> str:
    """SIGKILLed relay processes lose nothing, publish nothing rolled back, keep key order.

    Where the database cannot serve ordered claims (SQL Server without
    RCSI), the relays run unordered: loss and rolled-back events are still
    checked, key order is not (the detail says why).
    """
    if not hasattr(signal, "SIGKILL"):
        raise Skip("this platform has no SIGKILL")
    url = ctx.outbox.url
    if not ctx.dialect.session.shared_by_processes(url):
        raise Skip("an in-memory database cannot be shared with relay processes")
    unordered_because = _ordered_refused(ctx)
    size = SIZES.get(ctx.mode, SIZES["default"])
    with tempfile.TemporaryDirectory(prefix="outbox-verify-") as tmp:
        run = _Run(ctx, size, Path(tmp), ordered=unordered_because is None)
        run.go()
    return run.judge(unordered_because)


def _ordered_refused(ctx: Context) -> str | None:
    """Why the relays cannot run ordered here (None: they can)."""
    with ctx.outbox.engine.connect() as conn:
        try:
            ctx.dialect.check_ordered(conn)
        except UnsupportedDatabase as exc:
            return str(exc)
    return None


class _Run:
    """One SIGKILL run: the producer, the relays, the kills, then the verdict."""

    def __init__(self, ctx: Context, size: Size, work: Path, *, ordered: bool) -> None:
        self.ctx, self.size, self.work, self.ordered = ctx, size, work, ordered
        self.rng = random.Random()
        self.sink_file = work / "published.txt"
        self.committed: dict[str, tuple[str, int]] = {}
        self.rolled_back: set[str] = set()
        self.killed: list[int] = []
        self.records: list[tuple[str, int, float]] = []
        self.complaints: list[str] = []
        self.elapsed = 0.0

    def env(self) -> dict[str, str]:
        """The relays' settings: these alone, none of the user's ``OUTBOX_*`` or outbox.toml."""
        config = self.work / "outbox.toml"
        config.write_text("# outbox verify's SIGKILL run: settings come from the environment\n")
        inherited = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
        return {
            **inherited,
            "OUTBOX_CONFIG": str(config),
            # The URL goes in the environment, not argv: no password in `ps`.
            "OUTBOX_DATABASE_URL": self.ctx.outbox.url.render_as_string(hide_password=False),
            "OUTBOX_TABLE": self.ctx.outbox.table.name,
            "OUTBOX_BROKER_URL": "python://outbox_core.verify.sink:publish",
            "OUTBOX_VERIFY_SINK": str(self.sink_file),
            # Publishing takes a moment, as with a real broker: kills land mid-batch too.
            "OUTBOX_VERIFY_PUBLISH_SECONDS": "0.03",
            "OUTBOX_ORDERING": "partitions" if self.ordered else "none",
            "OUTBOX_LEASE": LEASE,
            "OUTBOX_BATCH_SIZE": "50",
            "OUTBOX_MAX_ATTEMPTS": "1000",
            "OUTBOX_REAP_INTERVAL": "0.5",
            "OUTBOX_POLL_INTERVAL": "0.05",
            "OUTBOX_MAX_POLL_INTERVAL": "0.3",
            "OUTBOX_BACKOFF_BASE": "0.2",
            "OUTBOX_BACKOFF_CAP": "1",
        }

    def kills(self) -> int:
        """SIGKILLs that hit a relay which had published (one at work)."""
        working = {pid for _, pid, _ in self.records}
        return sum(pid in working for pid in self.killed)

    def go(self) -> None:
        """Produce, kill and restart relays, wait for the drain; every process is gone after."""
        produced, stop, enough = threading.Event(), threading.Event(), threading.Event()
        errors: list[BaseException] = []
        producer = threading.Thread(
            target=_produce,
            args=(self.ctx, self.size, self.rng, self.committed, self.rolled_back),
            kwargs={"done": produced, "stop": stop, "enough": enough, "errors": errors},
            daemon=True,
        )
        started = time.monotonic()
        deadline = started + self.size.seconds + 120
        relays = _Relays(self.env(), self.work, runs=self.ordered)
        try:
            producer.start()
            while time.monotonic() < deadline and not errors:
                time.sleep(self.rng.uniform(0.3, 0.8))
                crashed = relays.failed()
                if crashed:
                    raise Failed(crashed)
                self.records = sink.read(str(self.sink_file))
                if self.kills() >= self.size.kills:
                    enough.set()
                if not produced.is_set() or self.kills() < self.size.kills:
                    victim = relays.kill_one(self.rng, {pid for _, pid, _ in self.records})
                    if victim is not None:
                        self.killed.append(victim)
                    continue
                if {e for e, _, _ in self.records} >= self.committed.keys() and self._drained():
                    break
        except BaseException:
            stop.set()
            relays.kill_all()
            raise
        finally:
            stop.set()
            producer.join()
        self.complaints = relays.stop()
        if errors:
            raise errors[0]
        self.elapsed = time.monotonic() - started
        self.records = sink.read(str(self.sink_file))

    def _drained(self) -> bool:
        """Nothing pending or leased: a relay killed between publishing and marking sent
        leaves its rows leased until their lease runs out and another relay takes them."""
        return not self._unsent()

    def _unsent(self) -> dict[str, int]:
        t = self.ctx.outbox.table
        with self.ctx.outbox.engine.connect() as conn:
            counts = conn.execute(sa.select(t.c.state, sa.func.count()).group_by(t.c.state))
            return {State(s).name.lower(): int(n) for s, n in counts if s != State.SENT}

    def judge(self, unordered_because: str | None) -> str:
        """The verdict on what the sink recorded and what the table holds; the run's summary."""
        records, committed, rolled_back = self.records, self.committed, self.rolled_back
        first: set[str] = set()
        last: dict[str, int] = {}
        violations: list[str] = []
        for event_id, _pid, _at in records:
            if event_id in first:
                continue
            first.add(event_id)
            if event_id not in committed:
                continue
            key, seq = committed[event_id]
            if seq != last.get(key, -1) + 1:
                violations.append(f"{key}: #{seq} after #{last.get(key)}")
            last[key] = seq
        kills = self.kills()
        expect(
            kills >= self.size.kills,
            f"only {kills} SIGKILLs hit a relay at work in the time allowed",
        )
        lost = committed.keys() - first
        expect(
            not (first & rolled_back), f"{len(first & rolled_back)} rolled-back events published"
        )
        expect(not (first - committed.keys() - rolled_back), "an event nobody wrote was published")
        expect(not lost, f"{len(lost)} of {len(committed)} committed events never published")
        if unordered_because is None:
            expect(not violations, f"first publications out of key order: {violations[:3]}")
        left = self._unsent()
        expect(not left, f"after the drain the table still has {left}")
        expect(
            not self.complaints,
            f"a relay did not stop cleanly: {self.complaints[0] if self.complaints else ''}",
        )
        summary = (
            f"{len(committed)} events over {self.size.keys} keys, {len(self.killed)} SIGKILLs "
            f"({kills} of relays that had published), "
            f"{len(records) - len(first)} published twice, {self.elapsed:.0f}s"
        )
        if unordered_because is not None:
            summary += f"; relays unordered, key order not checked: {unordered_because}"
        return summary


def _produce(
    ctx: Context,
    size: Size,
    rng: random.Random,
    committed: dict[str, tuple[str, int]],
    rolled_back: set[str],
    *,
    done: threading.Event,
    stop: threading.Event,
    enough: threading.Event,
    errors: list[BaseException],
) -> None:
    """Commit ``size.events`` events over ``size.seconds``, every tenth transaction rolled back;
    then go on at the same pace until ``enough`` kills hit relays at work (relays that drain
    faster than they are killed would otherwise have nothing left to be killed at)."""
    seq: dict[str, int] = {}
    per_tx = 10
    pause = size.seconds / max(size.events / per_tx, 1)
    try:
        while not stop.is_set() and len(committed) < MORE_EVENTS * size.events:
            if len(committed) >= size.events and enough.is_set():
                break
            batch: list[tuple[str, str, int]] = []
            roll_back = rng.random() < 0.1
            try:
                with ctx.outbox.engine.begin() as conn:
                    for _ in range(max(1, min(per_tx, size.events - len(committed)))):
                        key = f"k{rng.randrange(size.keys)}"
                        n = seq.get(key, 0) if not roll_back else -1
                        event_id = ctx.outbox.enqueue(conn, "verify.sigkill", {"n": n}, key=key)
                        batch.append((event_id, key, n))
                        if not roll_back:
                            seq[key] = n + 1
                    if roll_back:
                        raise RollBack
            except RollBack:
                rolled_back.update(e for e, _, _ in batch)
                continue
            for event_id, key, n in batch:
                committed[event_id] = (key, n)
            stop.wait(pause)
    except BaseException as exc:  # reported by the check
        errors.append(exc)
    finally:
        done.set()
