"""``outbox verify``'s ``fleet`` row: it runs the multi-outbox machine on the user's server.

On PostgreSQL and MariaDB the check creates schemas (databases) of its own,
runs the fleet machine over them and drops them; SQLite's row is a skip
that says why. A broken fleet fails the row, by name.
"""

from __future__ import annotations

import json
import re
import uuid

import pytest
import sqlalchemy as sa

from outbox_core import Outbox
from outbox_core.verify import fleet_check, verify
from outbox_core.verify.fleet_world import World
from tests.support import outbox_cli


def schemas(url: str) -> set[str]:
    engine = sa.create_engine(url)
    try:
        return set(sa.inspect(engine).get_schema_names())
    finally:
        engine.dispose()


def test_outbox_verify_runs_the_fleet_machine(backend: str, db_url: str) -> None:
    before = schemas(db_url) if backend != "sqlite" else set()
    done = outbox_cli("verify", "--db", db_url, "--quick", "--json", "--only", "fleet")
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    row = json.loads(done.stdout[done.stdout.index("{") :])
    [result] = row["results"]
    assert result["name"] == "fleet"
    if backend == "sqlite":
        assert result["status"] == "skip" and "no schemas" in result["detail"]
        return
    assert result["status"] == "pass", result["detail"]
    assert "examples of up to" in result["detail"]
    # Its own schemas, by the pattern the row names: other runs may be under way.
    [pattern] = re.findall(r"\((outbox_verify_f\w+)_\*, dropped\)", result["detail"])
    left = {s for s in schemas(db_url) - before if s.startswith(f"{pattern}_")}
    assert not left, left


def test_a_fleet_whose_settles_land_elsewhere_fails_the_row(
    backend: str, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if backend == "sqlite":
        pytest.skip("SQLite's fleet row is a skip")
    from outbox_core.fleet.cycle import FleetCycle

    real_owner = FleetCycle.owner

    def elsewhere(self: FleetCycle, claim):  # type: ignore[no-untyped-def]
        lane = real_owner(self, claim)
        others = [o for o in self.lanes() if o is not lane and not o.retired]
        return others[0] if others else lane

    monkeypatch.setattr(FleetCycle, "owner", elsewhere)
    # More examples than --quick's three: enough to meet a batch settled in the wrong place.
    monkeypatch.setitem(fleet_check.FLEET_BUDGET, "quick", (40, 20))
    report = verify(db_url, mode="quick", only=["fleet"])
    [result] = report.results
    assert result.status == "fail", result
    assert "did not land on" in result.detail
    assert not report.ok


def test_world_drops_every_schema_it_made(backend: str, db_url: str, outbox: Outbox) -> None:
    if backend == "sqlite":
        pytest.skip("no schemas")
    world = World(db_url, prefix=f"h4_world_{uuid.uuid4().hex[:6]}")
    world.start()
    made = set(world.live)
    assert len(made) == 3 and made <= schemas(db_url)
    world.close()
    assert not made & schemas(db_url)
