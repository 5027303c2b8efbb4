"""MkDocs hook: the reference tables, generated from the code at build time.

A page asks for a table with an HTML comment on a line of its own:
``<!-- generated: settings -->``, ``<!-- generated: metrics -->`` or
``<!-- generated: broker-options -->``. The tables come from the
``Settings`` dataclass (its fields and their ``#:`` comments), the metric
constructors in ``outbox_core.metrics`` and each broker's options dataclass,
so the reference cannot drift from the code. The command-line reference is
mkdocs-click's, from the click commands themselves.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
from collections.abc import Callable, Iterator
from typing import Any

import click

_DIRECTIVE = re.compile(r"^<!-- generated: ([a-z-]+) -->$", re.M)

#: Brokers with options, as their reference shows them: (title, URL schemes, options class).
BROKERS = [
    ("RabbitMQ", "amqp://, amqps://", "outbox_core.brokers.rabbitmq.options:RabbitMQOptions"),
    ("Kafka", "kafka://", "outbox_core.brokers.kafka.options:KafkaOptions"),
    ("NATS JetStream", "nats://", "outbox_core.brokers.nats.options:NatsOptions"),
    ("Redis Streams", "redis://, rediss://", "outbox_core.brokers.redis:RedisOptions"),
    ("Webhook", "http://, https://", "outbox_core.brokers.webhook:WebhookOptions"),
]

#: The classes of outbox_core.metrics that export metrics, and when each one does.
METRIC_SOURCES = {
    "RelayMetrics": "every relay",
    "BacklogCollector": "polling relays (read from the table at scrape time)",
    "PartitionCollector": "ordered relays with key partitions",
    "WalCollector": "log-tailing relays (`--source wal`)",
}

#: Metric constructors in outbox_core.metrics, and the kind each one exports.
_METRIC_KINDS = {
    "Counter": "counter",
    "CounterMetricFamily": "counter",
    "Gauge": "gauge",
    "GaugeMetricFamily": "gauge",
    "Histogram": "histogram",
}


def field_comments(cls: type) -> dict[str, str]:
    """Each field's ``#:`` comment lines, joined (Sphinx's attribute-comment style)."""
    comments: dict[str, str] = {}
    pending: list[str] = []
    for line in inspect.getsource(cls).splitlines()[1:]:
        stripped = line.strip()
        if stripped.startswith("#:"):
            pending.append(stripped[2:].strip())
            continue
        match = re.match(r"^\s{4}(\w+)\s*:", line)
        if match and pending:
            comments[match.group(1)] = " ".join(pending)
        pending = []
    return comments


def _load(target: str) -> Any:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _default(field: dataclasses.Field[Any]) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "required"
    return "unset" if value is None else f"`{value!r}`"


def _type(field: dataclasses.Field[Any]) -> str:
    text = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", "")
    return f"`{text}`"  # a pipe inside a code span does not split the row


def _cli_flags() -> dict[str, set[str]]:
    """Setting name -> the commands' long options that set it (``--batch-size``)."""
    from outbox_core.cli import main

    flags: dict[str, set[str]] = {}
    for command in main.commands.values():
        for param in command.params:
            if isinstance(param, click.Option) and param.name:
                longs = [o for o in param.opts + param.secondary_opts if o.startswith("--")]
                flags.setdefault(param.name, set()).update(longs)
    return flags


def settings_table() -> str:
    """Every ``Settings`` field: its variable, its TOML key, its flag, default and meaning."""
    from outbox_core.config import Settings

    comments = field_comments(Settings)
    flags = _cli_flags()
    rows = [
        "| setting (TOML key) | environment variable | flag | type | default | meaning |",
        "|---|---|---|---|---|---|",
    ]
    for field in dataclasses.fields(Settings):
        flag = ", ".join(f"`{f}`" for f in sorted(flags.get(field.name, ())))
        rows.append(
            f"| `{field.name}` | `OUTBOX_{field.name.upper()}` | {flag} | {_type(field)} "
            f"| {_default(field)} | {_cell(comments.get(field.name, ''))} |"
        )
    return "\n".join(rows)


def options_table(cls: type) -> str:
    """One broker's options: name, type, default and meaning."""
    comments = field_comments(cls)
    rows = ["| option | type | default | meaning |", "|---|---|---|---|"]
    for field in dataclasses.fields(cls):
        rows.append(
            f"| `{field.name}` | {_type(field)} | {_default(field)} "
            f"| {_cell(comments.get(field.name, ''))} |"
        )
    return "\n".join(rows)


def broker_options() -> str:
    """A section per broker with its options table."""
    parts = []
    for title, schemes, target in BROKERS:
        cls = _load(target)
        parts.append(
            f"## {title}\n\nURL schemes: `{schemes}`. Class: `{target.replace(':', '.')}`.\n\n"
            f"{options_table(cls)}\n"
        )
    return "\n".join(parts)


@dataclasses.dataclass(frozen=True)
class Metric:
    """One exported metric, as ``/metrics`` names it."""

    name: str
    kind: str
    help: str
    labels: tuple[str, ...]
    group: str


def metrics() -> Iterator[Metric]:
    """Every metric ``outbox_core.metrics`` constructs, with the class that exports it."""
    from outbox_core import metrics as module

    tree = ast.parse(inspect.getsource(module))
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        group = METRIC_SOURCES.get(cls.name, cls.name)
        for call in (n for n in ast.walk(cls) if isinstance(n, ast.Call)):
            func = call.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called not in _METRIC_KINDS or len(call.args) < 2:
                continue
            name, doc = (ast.literal_eval(a) for a in call.args[:2])
            kind = _METRIC_KINDS[called]
            labels: tuple[str, ...] = ()
            label_arg = call.args[2] if len(call.args) > 2 else None
            for keyword in call.keywords:
                if keyword.arg in ("labels", "labelnames"):
                    label_arg = keyword.value
            if isinstance(label_arg, ast.List | ast.Tuple):
                labels = tuple(ast.literal_eval(label_arg))
            if kind == "counter" and not name.endswith("_total"):
                name += "_total"
            yield Metric(name, kind, doc, labels, group)


def metrics_table() -> str:
    """Every metric: name, kind, labels, meaning and who exports it."""
    rows = ["| metric | kind | labels | meaning | exported by |", "|---|---|---|---|---|"]
    seen: set[str] = set()
    for metric in metrics():
        if metric.name in seen:
            continue
        seen.add(metric.name)
        labels = ", ".join(f"`{label}`" for label in metric.labels)
        rows.append(
            f"| `{metric.name}` | {metric.kind} | {labels} | {_cell(metric.help)} "
            f"| {_cell(metric.group)} |"
        )
    return "\n".join(rows)


GENERATORS: dict[str, Callable[[], str]] = {
    "settings": settings_table,
    "metrics": metrics_table,
    "broker-options": broker_options,
}


def render(markdown: str) -> str:
    """``markdown`` with each ``<!-- generated: NAME -->`` line replaced by its table."""

    def replace(match: re.Match[str]) -> str:
        return GENERATORS[match.group(1)]()

    return _DIRECTIVE.sub(replace, markdown)


def on_page_markdown(markdown: str, **_: Any) -> str:
    """The MkDocs event: fill in the generated tables."""
    return render(markdown)


__all__ = ["field_comments", "metrics", "on_page_markdown", "render"]
