"""``install``, ``status``, ``doctor``, ``cleanup`` and ``replay`` over many outboxes, on the
real PostgreSQL (several schemas) and MariaDB (two databases), as an operator types them.

Each outbox is reported under its label, with totals; a database that is down
(a URL to a closed port) is one failed row and never hides the others; a
pattern that matches nothing is an error, not a silent success; no password
is printed, whatever the command.
"""

from __future__ import annotations

import json
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from click.testing import CliRunner, Result

from outbox_core import Outbox, State
from outbox_core.cli import main
from tests.conftest import reachable_url

#: Settings from the environment would change what the commands see.
CLEAN_ENV: dict[str, str | None] = {
    name: None
    for name in (
        "OUTBOX_DATABASE_URL",
        "OUTBOX_DATABASE_URLS",
        "OUTBOX_SCHEMA",
        "OUTBOX_SCHEMAS",
        "OUTBOX_TABLE",
        "OUTBOX_BROKER_URL",
        "OUTBOX_SOURCE",
    )
}

#: In every URL the tests pass: it must never be printed (the servers trust loopback).
SECRET = "h1Secret"
DOWN_SECRET = "h1DownSecret"


def outbox(*args: str, env: dict[str, str | None] | None = None) -> Result:
    """``outbox ARGS`` in-process, stdout and stderr apart."""
    return CliRunner().invoke(main, list(args), env={**CLEAN_ENV, **(env or {})})


def printed(result: Result) -> str:
    return result.stdout + result.stderr


def with_password(url: str, password: str = SECRET) -> str:
    return sa.make_url(url).set(password=password).render_as_string(hide_password=False)


def down_url(url: str) -> str:
    """``url`` on a port nothing listens on (bound, then closed), with a password; its
    database ``h1_down`` (its label)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    made = sa.make_url(url).set(
        host="127.0.0.1", port=port, password=DOWN_SECRET, database="h1_down"
    )
    return made.render_as_string(hide_password=False)


def rows(text: str) -> dict[str, list[str]]:
    """The table's rows by their first cell."""
    return {line.split()[0]: line.split()[1:] for line in text.splitlines() if line.strip()}


def enqueue(url: str, schema: str | None, n: int, *, dead: int = 0, sent: int = 0) -> None:
    """``n`` events; the first ``dead`` made dead, the next ``sent`` sent an hour ago."""
    ob = Outbox(url, schema=schema)
    try:
        with ob.engine.begin() as conn:
            for i in range(n):
                ob.enqueue(conn, "h1.topic" if i % 2 else "h1.other", {"i": i}, key=f"k{i}")
        t = ob.table
        with ob.engine.begin() as conn:
            ids = sorted(conn.execute(sa.select(t.c.id)).scalars())
            if dead:
                conn.execute(t.update().where(t.c.id.in_(ids[:dead])).values(state=int(State.DEAD)))
            if sent:
                hour_ago = sa.func.now() - sa.text("INTERVAL 1 HOUR")
                if sa.make_url(url).get_backend_name() == "postgresql":
                    hour_ago = sa.func.now() - sa.text("INTERVAL '1 hour'")
                picked = ids[dead : dead + sent]
                conn.execute(
                    t.update()
                    .where(t.c.id.in_(picked))
                    .values(state=int(State.SENT), sent_at=hour_ago)
                )
    finally:
        ob.dispose()


@pytest.fixture
def pg(tmp_path: Path) -> Iterator[tuple[str, str, list[str]]]:
    """(URL with a password, pattern, three empty schemas ``h1_<random>_t0..2``), dropped after."""
    url = reachable_url("postgresql", tmp_path)
    prefix = f"h1_{uuid.uuid4().hex[:8]}"
    names = [f"{prefix}_t{i}" for i in range(3)]
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    with engine.begin() as conn:
        for name in names:
            conn.execute(sa.text(f'CREATE SCHEMA "{name}"'))
    try:
        yield with_password(url), f"{prefix}_t*", names
    finally:
        with engine.begin() as conn:
            for name in names:
                conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{name}" CASCADE'))
        engine.dispose()


@pytest.fixture
def maria(tmp_path: Path) -> Iterator[tuple[str, list[str]]]:
    """(server URL, two databases ``h1_<random>_m1``, ``_m2``), dropped after."""
    url = reachable_url("mysql", tmp_path)
    prefix = f"h1_{uuid.uuid4().hex[:8]}"
    names = [f"{prefix}_m1", f"{prefix}_m2"]
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    with engine.begin() as conn:
        for name in names:
            conn.execute(sa.text(f"CREATE DATABASE `{name}`"))
    try:
        yield url, names
    finally:
        with engine.begin() as conn:
            for name in names:
                conn.execute(sa.text(f"DROP DATABASE IF EXISTS `{name}`"))
        engine.dispose()


def test_postgresql_schemas_installed_reported_replayed_and_cleaned_per_outbox(
    pg: tuple[str, str, list[str]],
) -> None:
    url, pattern, names = pg
    installed = outbox("install", "--db", url, "--schemas", pattern)
    assert installed.exit_code == 0, printed(installed)
    assert set(rows(installed.stdout)) == {"outbox", *names, "installed"}
    assert "installed in 3 of 3 outboxes" in installed.stdout
    enqueue(url, names[0], 5, dead=2, sent=1)
    enqueue(url, names[1], 3, dead=1)

    status = outbox("status", "--db", url, "--schemas", pattern)
    assert status.exit_code == 0, printed(status)
    table = rows(status.stdout)
    # outbox, pending, leased, dead, oldest pending, relays
    assert table[names[0]][:3] == ["2", "0", "2"]
    assert table[names[1]][:3] == ["2", "0", "1"]
    assert table[names[2]] == ["0", "0", "0", "-", "0"]
    assert table["total"][:3] == ["4", "0", "3"]
    assert "3 of 3 outboxes answered" in status.stdout

    report = json.loads(outbox("status", "--db", url, "--schemas", pattern, "--json").stdout)
    assert list(report["outboxes"]) == names
    assert report["outboxes"][names[0]]["counts"] == {
        "pending": 2,
        "leased": 0,
        "sent": 1,
        "dead": 2,
    }
    assert report["totals"]["counts"] == {"pending": 4, "leased": 0, "sent": 1, "dead": 3}
    assert report["totals"]["outboxes"] == 3 and report["totals"]["failed"] == 0

    # An id is another event in each outbox: refused over many, taken on one.
    by_id = outbox("replay", "--db", url, "--schemas", pattern, "--id", "1")
    assert by_id.exit_code == 2 and "--id names rows of one outbox" in by_id.stderr
    one = outbox("replay", "--db", url, "--schema", names[1], "--id", "1")
    assert one.exit_code == 0 and "replayed 1 dead events" in one.stdout

    replayed = outbox("replay", "--db", url, "--schemas", pattern, "--all")
    assert replayed.exit_code == 0, printed(replayed)
    assert rows(replayed.stdout)[names[0]] == ["2"]
    assert rows(replayed.stdout)[names[1]] == ["0"]  # its one dead was replayed by id
    assert rows(replayed.stdout)["total"] == ["2"]

    cleaned = outbox("cleanup", "--db", url, "--schemas", pattern, "--older-than", "10m")
    assert cleaned.exit_code == 0, printed(cleaned)
    assert "cleanup: sent events older than" in cleaned.stdout
    assert rows(cleaned.stdout)[names[0]] == ["1"] and rows(cleaned.stdout)["total"] == ["1"]

    for result in (installed, status, by_id, replayed, cleaned):
        assert SECRET not in printed(result)


def test_a_database_down_shows_in_its_row_and_hides_no_other_outbox(
    pg: tuple[str, str, list[str]],
) -> None:
    url, pattern, names = pg
    assert outbox("install", "--db", url, "--schemas", pattern).exit_code == 0
    enqueue(url, names[0], 2, dead=1)
    down = down_url(url)
    both = ["--db", url, "--db", down, "--schemas", pattern]
    down_label = "h1_down"

    status = outbox("status", *both)
    assert status.exit_code == 1
    table = rows(status.stdout)
    assert table[names[0]][:3] == ["1", "0", "1"] and names[2] in table
    assert table[down_label][0] == "ERROR:" and "127.0.0.1" in status.stdout
    assert f"1 of 4 outboxes failed: {down_label}" in status.stderr

    report = json.loads(outbox("status", *both, "--json").stdout)
    assert report["outboxes"][names[0]]["counts"]["pending"] == 1
    assert "error" in report["outboxes"][down_label]
    assert report["totals"]["failed"] == 1 and report["totals"]["counts"]["dead"] == 1

    doctor = outbox("doctor", *both)
    assert doctor.exit_code == 1
    assert f"outbox doctor [{names[0]}]" in doctor.stdout
    assert f"outbox doctor [{down_label}]" in doctor.stdout
    assert "3 of 4 outboxes healthy" in doctor.stdout
    doctor_json = json.loads(outbox("doctor", *both, "--json").stdout)
    assert doctor_json["healthy"] is False
    assert doctor_json["outboxes"][names[0]]["healthy"] is True
    assert doctor_json["outboxes"][down_label]["findings"][0]["check"] == "connection"

    replayed = outbox("replay", *both, "--topic", "h1.other")
    assert replayed.exit_code == 1
    assert rows(replayed.stdout)[names[0]] == ["1"] and rows(replayed.stdout)["total"] == ["1"]
    cleaned = outbox("cleanup", *both)
    assert cleaned.exit_code == 1 and rows(cleaned.stdout)["total"] == ["0"]

    for result in (status, doctor, replayed, cleaned):
        assert SECRET not in printed(result) and DOWN_SECRET not in printed(result)


def test_a_pattern_matching_nothing_is_an_error(pg: tuple[str, str, list[str]]) -> None:
    url, pattern, _ = pg
    nothing = pattern.replace("_t*", "_none_*")
    install = outbox("install", "--db", url, "--schemas", nothing)
    assert install.exit_code == 2
    assert f"--schemas {nothing!r} matched no schema on" in install.stderr
    assert SECRET not in printed(install)
    # Schemas exist, none holds the table yet: status says so, and how to fix it.
    status = outbox("status", "--db", url, "--schemas", pattern)
    assert status.exit_code == 2
    assert "matched no schema holding table 'outbox'" in status.stderr
    assert "outbox install --schemas" in status.stderr


def test_settings_from_the_environment_and_outbox_toml_name_many_outboxes(
    pg: tuple[str, str, list[str]], tmp_path: Path
) -> None:
    url, pattern, names = pg
    env: dict[str, str | None] = {"OUTBOX_DATABASE_URL": url, "OUTBOX_SCHEMAS": pattern}
    assert outbox("install", env=env).exit_code == 0
    enqueue(url, names[2], 1)
    report = json.loads(outbox("status", "--json", env=env).stdout)
    assert report["outboxes"][names[2]]["counts"]["pending"] == 1
    config = tmp_path / "outbox.toml"
    config.write_text(f'database_url = "{url}"\nschemas = "{pattern}"\n')
    status = outbox("status", "--config", str(config))
    assert status.exit_code == 0 and rows(status.stdout)["total"][0] == "1"


def test_mariadb_two_databases_by_url_and_by_pattern(maria: tuple[str, list[str]]) -> None:
    server, names = maria
    # MariaDB's root here refuses any password: the down URL carries the one to hide.
    urls = [sa.make_url(server).set(database=name).render_as_string() for name in names]
    by_url = ["--db", urls[0], "--db", urls[1]]
    installed = outbox("install", *by_url)
    assert installed.exit_code == 0, printed(installed)
    assert set(names) <= set(rows(installed.stdout))
    enqueue(urls[0], None, 3, dead=1)
    enqueue(urls[1], None, 1)

    status = outbox("status", *by_url)
    assert status.exit_code == 0, printed(status)
    assert rows(status.stdout)[names[0]][:3] == ["2", "0", "1"]
    assert rows(status.stdout)["total"][:3] == ["3", "0", "1"]

    # The same two as one server's databases matching a pattern.
    pattern = names[0][: -len("1")] + "*"
    report = json.loads(outbox("status", "--db", server, "--schemas", pattern, "--json").stdout)
    assert list(report["outboxes"]) == names
    assert report["totals"]["counts"]["pending"] == 3

    doctor = outbox("doctor", "--db", server, "--schemas", pattern)
    assert f"outbox doctor [{names[1]}]" in doctor.stdout
    assert "2 of 2 outboxes healthy" in doctor.stdout, doctor.stdout

    with_down = outbox("replay", *by_url, "--db", down_url(urls[0]), "--all")
    assert with_down.exit_code == 1
    assert rows(with_down.stdout)[names[0]] == ["1"] and rows(with_down.stdout)["total"] == ["1"]
    for result in (installed, status, doctor, with_down):
        assert DOWN_SECRET not in printed(result)
