"""Outboxes named by settings: labels, weights, patterns and the refusals."""

from __future__ import annotations

import fnmatch

import pytest
import sqlalchemy as sa

from outbox_core.config import Settings, load_settings
from outbox_core.dialects.base.discovery import like_prefix, probe
from outbox_core.errors import ConfigurationError
from outbox_core.fleet.targets import Databases, Member, database_urls, is_many, label, weight_of
from outbox_core.outbox import Outbox


def members(*specs: tuple[str, str | None]) -> list[Member]:
    return [Member("", Outbox(url, schema=schema), "db") for url, schema in specs]


def test_labels_are_schemas_else_databases_qualified_only_on_a_clash() -> None:
    pg = "postgresql+psycopg://u@h1:5432/app"
    found = label(members((pg, "tenant_a"), (pg, "tenant_b")))
    assert [m.label for m in found] == ["tenant_a", "tenant_b"]
    found = label(
        members(("mysql+pymysql://u@h/shop", None), ("mysql+pymysql://u@h/billing", None))
    )
    assert [m.label for m in found] == ["shop", "billing"]
    clash = label(
        members(
            ("postgresql+psycopg://u@h1/app", "tenant_a"),
            ("postgresql+psycopg://u@h2/crm", "tenant_a"),
        )
    )
    assert [m.label for m in clash] == ["app.tenant_a", "crm.tenant_a"]
    same_name = label(
        members(
            ("postgresql+psycopg://u@h1:5432/app", "t"),
            ("postgresql+psycopg://u@h2:5433/app", "t"),
        )
    )
    assert [m.label for m in same_name] == ["h1:5432/app.t", "h2:5433/app.t"]


def test_a_label_never_holds_a_password() -> None:
    found = label(
        members(
            ("postgresql+psycopg://u:s3cret@h1/app", "t"),
            ("postgresql+psycopg://u:s3cret@h2/app", "t"),
        )
    )
    assert all("s3cret" not in m.label for m in found)


def test_weights_match_labels_by_pattern_first_match_wins() -> None:
    weights = load_settings({"weights": "tenant_big=3,tenant_*=2"}).weights
    assert weight_of("tenant_big", weights) == 3
    assert weight_of("tenant_x", weights) == 2
    assert weight_of("other", weights) == 1


@pytest.mark.parametrize("bad", ["tenant=0", "tenant=x", "tenant=101", "=3", "tenant"])
def test_bad_weights_are_refused_by_name(bad: str) -> None:
    with pytest.raises(ConfigurationError, match="weights"):
        load_settings({"weights": bad})


def test_many_urls_from_flags_env_and_toml(tmp_path: object) -> None:
    env = {"OUTBOX_DATABASE_URLS": "postgresql://a/x mysql+pymysql://b/y"}
    settings = load_settings({"database_url": "sqlite:///z.db"}, env=env)
    assert database_urls(settings) == ["sqlite:///z.db", "postgresql://a/x", "mysql+pymysql://b/y"]
    assert is_many(settings)
    assert not is_many(Settings(database_url="sqlite:///z.db"))
    assert is_many(Settings(database_url="postgresql://a/x", schemas="tenant_*"))


def test_a_schema_and_a_pattern_together_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="schema and schemas"):
        Settings(database_url="postgresql://a/x", schema="s", schemas="t_*")


def test_the_settings_never_show_a_password_of_any_url() -> None:
    settings = Settings(database_urls=("postgresql://u:s3cret@h/x", "mysql://r:pw2@h/y"))
    assert "s3cret" not in repr(settings) and "pw2" not in repr(settings)


def test_sqlite_has_no_schemas_to_match() -> None:
    with pytest.raises(ConfigurationError, match="SQLite has no schemas"):
        Databases(Settings(database_url="sqlite:///x.db", schemas="t_*"))


@pytest.mark.parametrize(
    ("pattern", "like"),
    [("tenant_*", "tenant\\_%"), ("t?x", "t%"), ("*", "%"), ("a%b[c]", "a\\%b%")],
)
def test_the_like_prefix_narrows_and_fnmatch_decides(pattern: str, like: str) -> None:
    assert like_prefix(pattern) == like
    assert fnmatch.fnmatchcase("tenant_1", "tenant_*")


@pytest.mark.parametrize(
    "url",
    [
        "postgresql+psycopg://u@h/app",
        "mysql+pymysql://u@h/app",
        "mssql+pyodbc://u@h/app?driver=x",
        "sqlite:///app.db",
    ],
)
def test_the_probe_is_one_statement_for_many_outboxes(url: str) -> None:
    dialects = [Outbox(url, schema=None if "sqlite" in url else f"t{i}").dialect for i in range(3)]
    seen: list[str] = []
    engine = sa.create_engine("sqlite://")

    class Recorder:
        def execute(self, statement: sa.Executable, params: object = None) -> object:
            seen.append(str(statement.compile(dialect=engine.dialect)))

            class Rows:
                def all(self) -> list[tuple[int, int]]:
                    return [(1, 1), (1, 2), (2, 2)]

            return Rows()

        def in_transaction(self) -> bool:
            return True

    found = probe(Recorder(), dialects)  # type: ignore[arg-type]
    assert len(seen) == 1
    assert seen[0].count("EXISTS") == 6
    assert [(d.index, d.pending, d.expired) for d in found] == [(1, True, True), (2, False, True)]
