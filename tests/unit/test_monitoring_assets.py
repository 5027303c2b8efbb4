"""The shipped alert rules and Grafana dashboard (deploy/): they load, their tests pass and
can fail, and every metric they read is one the relay exports.

- promtool checks deploy/prometheus/outbox-alerts.yml and runs its unit tests
  (deploy/prometheus/outbox-alerts.test.yml); copies of the rules with a threshold
  flipped, a ``for:`` shortened or a condition dropped fail those tests;
- the dashboard's queries parse as PromQL (promtool), and its JSON has what an import
  needs (a Prometheus data source variable, unique panel ids);
- the metric names in the rules, their tests' input series and every panel's query
  are names the code exports, collected from a registry built as ``/metrics`` builds it;
- ``outbox_partitions_unowned`` counts the partitions in no live relay's share of the
  membership table, on every database.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import sqlalchemy as sa
import yaml

from brokers.memory import MemoryBroker, MemoryQueue
from outbox_core import Outbox
from outbox_core.dialects.base.partitioned import Member
from outbox_core.outbox import Status
from outbox_core.partitions import PARTITIONS, parse
from outbox_core.relay import Relay
from outbox_core.relay.tailing.source import SourceFacts
from tests.conftest import require_system_tool

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "outbox-alerts.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "outbox-alerts.test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "outbox-dashboard.json"

#: What Grafana puts in place of the dashboard's variables when it runs a query.
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$job": "outbox-relay"}


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [require_system_tool("promtool"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def rules() -> list[dict[str, Any]]:
    return [
        rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]
    ]


def dashboard() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


def panels() -> Iterator[dict[str, Any]]:
    """Every panel, those inside collapsed rows included."""
    for panel in dashboard()["panels"]:
        yield panel
        yield from panel.get("panels", [])


def panel_exprs() -> list[tuple[str, str]]:
    """(panel title, query) of every panel's targets."""
    return [(p["title"], t["expr"]) for p in panels() for t in p.get("targets", [])]


def for_grafana(expr: str) -> str:
    """``expr`` as Grafana sends it (variables replaced)."""
    for name, value in sorted(GRAFANA_VARIABLES.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(name, value)
    return expr


# -- promtool ------------------------------------------------------------------------------


@pytest.mark.system_tool
def test_promtool_checks_the_rules_and_their_tests_pass() -> None:
    checked = promtool("check", "rules", RULES.name, cwd=RULES.parent)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(rules())} rules found" in checked.stdout
    tested = promtool("test", "rules", RULE_TESTS.name, cwd=RULES.parent)
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_every_alert_has_a_test_that_fires_it_and_one_that_must_not() -> None:
    fired: set[str] = set()
    quiet: set[str] = set()
    for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for check in case["alert_rule_test"]:
            (fired if check["exp_alerts"] else quiet).add(check["alertname"])
    names = {rule["alert"] for rule in rules()}
    assert names - fired == set(), "no test fires these"
    assert names - quiet == set(), "no test keeps these quiet"
    for rule in rules():
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert "Threshold" in rule["annotations"]["description"], rule["alert"]


#: Broken copies of the rules (text replaced once), each of which the tests must catch.
BROKEN = {
    "threshold-flipped": (
        "expr: max by (job) (outbox_oldest_pending_age_seconds) > 300",
        "expr: max by (job) (outbox_oldest_pending_age_seconds) < 300",
    ),
    "inflow-needs-less-than-10-minutes": (
        "and max by (job) (outbox_pending_events) > 1000\n        for: 10m",
        "and max by (job) (outbox_pending_events) > 1000\n        for: 8m",
    ),
    "inflow-ignores-the-backlog-size": (
        "\n          and max by (job) (outbox_pending_events) > 1000",
        "",
    ),
    "relay-missing-counts-any-job": (
        'absent(up{job="outbox-relay"} == 1)',
        "absent(up == 1)",
    ),
    "unowned-partitions-fire-at-once": (
        "expr: max by (job) (outbox_partitions_unowned) > 0\n        for: 2m",
        "expr: max by (job) (outbox_partitions_unowned) > 0\n        for: 0m",
    ),
}


@pytest.mark.system_tool
@pytest.mark.parametrize("change", BROKEN.values(), ids=list(BROKEN))
def test_a_broken_rule_fails_the_tests(change: tuple[str, str], tmp_path: Path) -> None:
    old, new = change
    text = RULES.read_text()
    assert text.count(old) == 1, f"the rules no longer hold {old!r}"
    (tmp_path / RULES.name).write_text(text.replace(old, new))
    (tmp_path / RULE_TESTS.name).write_text(RULE_TESTS.read_text())
    assert promtool("check", "rules", RULES.name, cwd=tmp_path).returncode == 0
    tested = promtool("test", "rules", RULE_TESTS.name, cwd=tmp_path)
    assert tested.returncode != 0, tested.stdout
    assert "FAILED" in tested.stdout + tested.stderr


@pytest.mark.system_tool
def test_the_dashboard_queries_parse(tmp_path: Path) -> None:
    """promtool parses each query, variables replaced, as a recording rule's expression."""
    records = [
        {"record": f"dashboard:panel_{n}", "expr": for_grafana(expr)}
        for n, (_, expr) in enumerate(panel_exprs())
    ]
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": records}]}))
    checked = promtool("check", "rules", path.name, cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr


# -- the dashboard's JSON ----------------------------------------------------------------------


def test_the_dashboard_imports_with_a_prometheus_data_source_variable() -> None:
    board = dashboard()
    assert board["schemaVersion"] >= 39
    assert board["uid"] and board["title"]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    source = {"type": "prometheus", "uid": "${datasource}"}
    ids = [p["id"] for p in panels()]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for panel in panels():
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == source, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == source, panel["title"]
            assert target["expr"].strip(), panel["title"]
        right = panel["gridPos"]["x"] + panel["gridPos"]["w"]
        assert right <= 24, panel["title"]
    titles = " / ".join(p["title"] for p in panels()).lower()
    for wanted in (
        "pending",
        "oldest pending age",
        "inflow vs outflow",
        "dead events",
        "publish failures by reason",
        "publish latency",
        "broker and database up",
        "partitions owned per relay, and unowned",
        "wal lag and retained",
    ):
        assert wanted in titles, wanted


def test_the_inflow_panel_adds_the_pending_growth_to_the_outflow() -> None:
    queries = dict(panel_exprs_by_legend("Inflow vs outflow"))
    assert "rate(outbox_events_published_total" in queries["outflow (published)"]
    inflow = queries["inflow (enqueued)"]
    assert "rate(outbox_events_published_total" in inflow
    assert "max(deriv(outbox_pending_events" in inflow


@pytest.mark.system_tool
def test_the_inflow_panel_counts_what_producers_enqueue(tmp_path: Path) -> None:
    """Published 10/s, made dead 1/s, the backlog growing 5/s (seen by two relays): 16/s in."""
    queries = dict(panel_exprs_by_legend("Inflow vs outflow"))
    relay = 'job="outbox-relay",instance="a:9108"'
    case = {
        "interval": "1m",
        "input_series": [
            {"series": f'outbox_events_published_total{{{relay},topic="t"}}', "values": "0+600x30"},
            {"series": f'outbox_events_dead_total{{{relay},topic="t"}}', "values": "0+60x30"},
            {"series": f"outbox_pending_events{{{relay}}}", "values": "100+300x30"},
            {
                "series": 'outbox_pending_events{job="outbox-relay",instance="b:9108"}',
                "values": "100+300x30",
            },
        ],
        "promql_expr_test": [
            {
                "expr": for_grafana(queries[legend]),
                "eval_time": "20m",
                "exp_samples": [{"labels": "{}", "value": value}],
            }
            for legend, value in (("inflow (enqueued)", 16), ("outflow (published)", 10))
        ],
    }
    (tmp_path / "none.yml").write_text("groups: []\n")
    spec = {"rule_files": ["none.yml"], "evaluation_interval": "1m", "tests": [case]}
    (tmp_path / "inflow.test.yml").write_text(yaml.safe_dump(spec))
    tested = promtool("test", "rules", "inflow.test.yml", cwd=tmp_path)
    assert tested.returncode == 0, tested.stdout + tested.stderr


def panel_exprs_by_legend(title: str) -> Iterator[tuple[str, str]]:
    for panel in panels():
        if panel["title"] == title:
            for target in panel["targets"]:
                yield target["legendFormat"], target["expr"]


# -- metric names: what the assets read is what the code exports -----------------------------

_PROMQL_WORDS = """
abs absent absent_over_time avg_over_time ceil changes clamp clamp_max clamp_min
count_over_time day_of_month day_of_week days_in_month delta deriv exp floor
histogram_count histogram_fraction histogram_quantile histogram_sum holt_winters
hour idelta increase irate label_join label_replace last_over_time ln log10 log2
max_over_time min_over_time minute month predict_linear present_over_time
quantile_over_time rate resets round scalar sgn sort sort_desc sqrt
stddev_over_time stdvar_over_time sum_over_time time timestamp vector year
sum min max avg group stddev stdvar count count_values bottomk topk quantile
by without on ignoring group_left group_right and or unless bool offset
inf nan atan2
"""
#: PromQL's functions, aggregations and keywords: words of a query that are not metrics.
PROMQL_WORDS = set(_PROMQL_WORDS.split())


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (``up`` included)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)  # strings
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges and subqueries
    # Label lists: by (le), on (job), group_left (topic) ...
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", r" \1 ", text)
    text = re.sub(r"\$\{?\w+\}?", " ", text)  # Grafana variables
    # Not inside a number (1e9) nor after a dot.
    words = re.findall(r"(?<![\w.])[A-Za-z_:][\w:]*", text)
    return {w for w in words if w not in PROMQL_WORDS}


def series_name(selector: str) -> str:
    """The metric name of a promtool input series (``name{label="v"}``)."""
    return selector.split("{", 1)[0].strip()


def load_hook() -> Any:
    """docs/hooks/reference.py: the metrics the code constructs, as the reference lists them."""
    spec = importlib.util.spec_from_file_location(
        "docs_reference_monitoring", ROOT / "docs" / "hooks" / "reference.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


class FakeConnect:
    """An engine whose connections the fake statements below ignore."""

    def __init__(self, fails: bool = False) -> None:
        self.fails = fails

    @contextmanager
    def connect(self) -> Iterator[object]:
        if self.fails:
            raise sa.exc.OperationalError("SELECT 1", {}, Exception("connection refused"))
        yield object()


def fake_partition_relay(members: list[Member], *, fails: bool = False) -> Any:
    statements = SimpleNamespace(
        members=lambda conn: members, oldest_pending=lambda conn, partitions: 4.0
    )
    return SimpleNamespace(
        engine=FakeConnect(fails), dialect=SimpleNamespace(partitions=statements)
    )


def fake_membership(share: str = "0-127") -> Any:
    return SimpleNamespace(share=share, share_changes=1, stale_after=10.0)


def fake_tailing_relay() -> Any:
    # Both lags set (no source has both: PostgreSQL counts bytes, the binlog transactions),
    # so the fake reaches each branch.
    facts = SourceFacts(
        active=True,
        reader_pid=1,
        confirmed=0,
        lag_bytes=100,
        retained_bytes=2000,
        lag_transactions=3,
    )
    table = SimpleNamespace(
        deferred=SimpleNamespace(oldest=lambda conn: (1, datetime.now(UTC))),
        dead_count=lambda conn: 0,
    )
    source = SimpleNamespace(facts=lambda conn: facts, table=table)
    return SimpleNamespace(held=2, oldest_unpublished=None, engine=FakeConnect(), source=source)


@pytest.fixture(scope="module")
def exported() -> set[str]:
    """Every name ``/metrics`` can serve: each collector of outbox_core.metrics in one
    registry (fakes stand for the database), named as prometheus_client exposes them."""
    prometheus_client = pytest.importorskip("prometheus_client")
    from outbox_core.metrics import (
        BacklogCollector,
        PartitionCollector,
        RelayMetrics,
        WalCollector,
    )

    registry = prometheus_client.CollectorRegistry()
    RelayMetrics(registry)
    outbox = SimpleNamespace(status=lambda: Status({"pending": 3, "dead": 1}, 2.5))
    registry.register(BacklogCollector(outbox))  # type: ignore[arg-type]
    members = [Member("r1", "h", 0.5, "0-127", 1)]
    registry.register(PartitionCollector(fake_partition_relay(members), fake_membership()))
    registry.register(WalCollector(fake_tailing_relay()))
    families = list(registry.collect())
    # The fakes reach every branch: every metric the code constructs is there.
    constructed = {m.name for m in load_hook().metrics()}
    collected = {m.name + ("_total" if m.type == "counter" else "") for m in families}
    assert constructed <= collected, constructed - collected
    # prometheus_client's sample names: a counter's _total, a histogram's series.
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    return {m.name + suffix for m in families for suffix in suffixes.get(m.type, ("",))}


def test_the_name_check_finds_metrics_and_catches_an_unknown_one(exported: set[str]) -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le) (rate(outbox_publish_latency_seconds_bucket{job=~"a"}'
        "[$__rate_interval]))) > 1e3 and on (job) max without (instance) "
        "(outbox_events_sent_total offset 5m) or vector(0)"
    )
    assert metric_names(expr) == {
        "outbox_publish_latency_seconds_bucket",
        "outbox_events_sent_total",
    }
    assert metric_names(expr) - exported == {"outbox_events_sent_total"}
    # A histogram's or a counter's bare name is not what /metrics serves.
    assert "outbox_publish_latency_seconds" not in exported
    assert "outbox_events_published" not in exported


def test_the_rules_read_only_exported_metrics(exported: set[str]) -> None:
    used = {name for rule in rules() for name in metric_names(rule["expr"])}
    assert "outbox_partitions_unowned" in used
    assert used - exported == {"up"}


def test_the_rule_tests_feed_exported_metrics(exported: set[str]) -> None:
    fed = {
        series_name(series["series"])
        for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]
        for series in case["input_series"]
    }
    assert fed - exported - {"up"} == set()


def test_every_panel_reads_exported_metrics(exported: set[str]) -> None:
    unknown = {
        f"{title}: {name}"
        for title, expr in panel_exprs()
        for name in metric_names(expr)
        if name not in exported and name != "up"
    }
    assert not unknown
    for variable in dashboard()["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["definition"]
            found = re.findall(r"label_values\((\w+)", query)
            assert found and set(found) <= exported, query


def test_the_docs_show_the_shipped_rules() -> None:
    page = (ROOT / "docs" / "operations.md").read_text(encoding="utf-8")
    assert '--8<-- "deploy/prometheus/outbox-alerts.yml"' in page
    assert "deploy/grafana/outbox-dashboard.json" in page
    for rule in rules():
        assert rule["alert"] in page, f"{rule['alert']} is not described in operations.md"


# -- outbox_partitions_unowned ------------------------------------------------------------------


def gauges(collector: Any) -> dict[str, float]:
    return {m.name: m.samples[0].value for m in collector.collect()}


def test_unowned_counts_stale_members_and_gaps() -> None:
    from outbox_core.metrics import unowned_partitions

    assert unowned_partitions([], 10.0) == PARTITIONS
    live = Member("a", "h", 1.0, "0-127", 3)
    stale = Member("b", "h", 11.0, "128-255", 3)
    assert unowned_partitions([live, stale], 10.0) == 128
    assert unowned_partitions([live, stale], 20.0) == 0
    overlapping = Member("c", "h", 0.0, "100-200", 3)
    assert unowned_partitions([live, overlapping], 10.0) == PARTITIONS - 201


def test_no_unowned_gauge_while_the_database_does_not_answer() -> None:
    pytest.importorskip("prometheus_client")
    from outbox_core.metrics import PartitionCollector

    down = PartitionCollector(fake_partition_relay([], fails=True), fake_membership())
    assert set(gauges(down)) == {"outbox_partitions_owned", "outbox_partition_changes"}
    up = PartitionCollector(fake_partition_relay([]), fake_membership(share=""))
    assert gauges(up)["outbox_partitions_unowned"] == PARTITIONS
    assert "outbox_partition_oldest_pending_seconds" not in gauges(up)  # it owns none


@pytest.fixture
def relays() -> Iterator[list[Relay]]:
    made: list[Relay] = []
    yield made
    for relay in made:
        relay.close()


def ordered_relay(outbox: Outbox, made: list[Relay]) -> Relay:
    relay = outbox.relay(
        MemoryBroker(MemoryQueue(f"unowned-{uuid.uuid4().hex[:6]}")),
        ordered=True,
        reap_interval=0,
        cleanup_after=0,
        notify=False,
        # Live for the whole test however slow the machine: only the row made stale is.
        heartbeat=1.0,
        stale_after=60.0,
        lease=2.0,
    )
    made.append(relay)
    return relay


def share_of(relay: Relay) -> set[int]:
    assert relay.membership is not None
    with relay.engine.connect() as conn:
        members = relay.dialect.partitions.members(conn)
    return {
        p for m in members if m.relay_id == relay.membership.relay_id for p in parse(m.partitions)
    }


def test_the_unowned_gauge_reads_the_membership_table(outbox: Outbox, relays: list[Relay]) -> None:
    """Nobody joined: every partition; two live relays: none; one stale: its share, until a
    live relay's rebalance moves it."""
    pytest.importorskip("prometheus_client")
    from outbox_core.metrics import PartitionCollector

    a, b = ordered_relay(outbox, relays), ordered_relay(outbox, relays)
    assert a.membership is not None and b.membership is not None
    collector = PartitionCollector(a, a.membership)
    assert gauges(collector)["outbox_partitions_unowned"] == PARTITIONS
    a.membership.tick()
    b.membership.tick()
    assert share_of(a) | share_of(b) == set(range(PARTITIONS)) and share_of(b)
    assert gauges(collector)["outbox_partitions_unowned"] == 0
    # b's heartbeat stops: its row is stale (on the database's clock) but still there.
    relays_table = outbox.tables.relays
    with outbox.engine.begin() as conn:
        conn.execute(
            sa.update(relays_table)
            .where(relays_table.c.relay_id == b.membership.relay_id)
            .values(heartbeat_at=datetime(2000, 1, 1))
        )
    assert gauges(collector)["outbox_partitions_unowned"] == len(share_of(b)) > 0
    a.membership.rebalance()  # what a's next heartbeat does: b's partitions move to a
    assert share_of(a) == set(range(PARTITIONS))
    assert gauges(collector)["outbox_partitions_unowned"] == 0
