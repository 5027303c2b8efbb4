"""What the commands print beyond one line: the status table, a broker probe, migrate's progress."""

from __future__ import annotations

import sys
import time
from typing import Any

import click

from outbox_core.cli.many import Outcome, render_table, results
from outbox_core.outbox import Status


def format_age(seconds: float | None) -> str:
    """An age in the unit that reads best (``-`` for none)."""
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"


def broker_line(probe: dict[str, Any]) -> str:
    """One line on a broker probe (:func:`~outbox_core.cli.options.probe_broker`)."""
    state = "up" if probe["up"] else f"DOWN: {probe['error']}"
    return f"broker {probe['url']}: {state}"


def format_bytes(n: int | None) -> str:
    """A byte count in the unit that reads best (``-`` for none)."""
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def render_log_tailing(t: dict[str, Any]) -> list[str]:
    """The log source's lines (``outbox status --source wal`` or ``--source binlog``)."""
    lines = _binlog_head(t) if "lag_transactions" in t else _slot_head(t)
    if not t["exists"]:
        return lines
    oldest = format_age(t["oldest_unpublished_age"])
    if t["unread_bytes"] is not None:
        lines.append(f"unread: {format_bytes(t['unread_bytes'])} of WAL past the relay's last read")
    if t["report_age"] is None:
        lines.append("oldest unpublished: unknown (no relay has reported yet)")
    elif t["estimated"]:
        ago = format_age(t["report_age"])
        lines.append(f"in flight: unknown (relay {t['relay']} held {t['held']} {ago} ago)")
        lines.append(
            f"oldest unpublished: {oldest} (estimated: relay {t['relay']} last reported {ago} ago)"
        )
    else:
        lines.append(f"in flight: {t['held']} events held by relay {t['relay']}")
        lines.append(f"oldest unpublished: {oldest}")
    if t["deferred"]:
        lines.append(f"deferred: {t['deferred']} events wait in the table (long delays, backoffs)")
    return lines


def _slot_head(t: dict[str, Any]) -> list[str]:
    if not t["exists"]:
        return [f"replication slot {t['slot']!r}: missing (`outbox install --source wal`)"]
    reader = f"read by pid {t['reader_pid']}" if t["active"] else "NOT READ: no relay is connected"
    return [
        f"replication slot {t['slot']!r}: {reader}, confirmed {t['confirmed_lsn'] or '-'}",
        f"slot lag: {format_bytes(t['lag_bytes'])} of WAL since its confirmed position, "
        f"{format_bytes(t['retained_bytes'])} retained on the server",
    ]


def _binlog_head(t: dict[str, Any]) -> list[str]:
    if not t["exists"]:
        return [f"binlog source {t['slot']!r}: missing (`outbox install --source binlog`)"]
    reader = (
        f"read by connection {t['reader_pid']}"
        if t["active"]
        else "NOT READ: no relay holds its lock"
    )
    lag = t["lag_transactions"]
    return [
        f"binlog source {t['slot']!r}: {reader}, confirmed {t['confirmed_lsn'] or '-'}",
        f"lag: {'-' if lag is None else lag} transactions to the binlog's end "
        f"{t['binlog_end'] or '-'}, {format_bytes(t['retained_bytes'])} of binlog kept in "
        f"{t['binlog_files'] if t['binlog_files'] is not None else '-'} files",
    ]


def render_status(status: Status) -> str:
    """The status as a readable table."""
    if status.log_tailing is not None:
        # Log tailing leaves rows pending: the stream says what is out.
        lines = render_log_tailing(status.log_tailing)
        created, published = status.created_last_minute, status.log_tailing["published_last_minute"]
        out = "-" if published is None else f"{published} published ({published / 60:.1f}/s)"
        lines.append(f"last minute: {created} enqueued ({created / 60:.1f}/s), {out}")
        lines.append(
            f"table: {sum(status.counts.values())} rows, {status.counts.get('dead', 0)} dead "
            "(rows stay pending once published, until cleanup)"
        )
    else:
        lines = ["state     events"]
        lines += [f"{state:<9} {n:>6}" for state, n in status.counts.items()]
        lines.append(f"oldest pending: {format_age(status.oldest_pending_age)}")
        lines.append(
            f"last minute: {status.created_last_minute} in, {status.sent_last_minute} out"
            f" ({status.created_last_minute / 60:.1f}/s in,"
            f" {status.sent_last_minute / 60:.1f}/s out)"
        )
        lines.append(f"last sent: {format_age(status.last_sent_age)} ago")
    if status.broker is not None:
        lines.append(broker_line(status.broker))
    if status.fleet:
        lines.append("")
        lines.append("relays:")
        for p in status.fleet:
            lines.append(
                f"  {p.relay_id:<40} {p.mode:<10} heartbeat {format_age(p.heartbeat_age)} ago, "
                f"up {format_age(p.uptime)}, {p.published} published "
                f"({p.published_last_minute} last minute), {p.dead} dead, "
                f"on {p.host} pid {p.pid}"
            )
    if status.relays:
        lines.append("")
        lines.append("ordered relays (key partitions):")
        for r in status.relays:
            lines.append(
                f"  {r.relay_id:<40} {r.count:>3} partitions ({r.partitions}), "
                f"heartbeat {format_age(r.heartbeat_age)} ago, epoch {r.epoch}, on {r.host}"
            )
    if status.dead:
        lines.append("")
        lines.append("dead events by topic:")
        for d in status.dead:
            error = (d.last_error or "").splitlines()[0][:100] if d.last_error else ""
            lines.append(f"  {d.topic:<30} {d.count:>6}  last error: {error}")
    return "\n".join(lines)


#: The columns of ``outbox status`` over many outboxes.
STATUS_COLUMNS = ("outbox", "pending", "leased", "dead", "oldest pending", "relays")


def status_cells(status: Status) -> list[str]:
    """One outbox's row of ``outbox status`` over many outboxes (after its label)."""
    counts = status.counts
    return [
        str(counts.get("pending", 0)),
        str(counts.get("leased", 0)),
        str(counts.get("dead", 0)),
        format_age(status.oldest_pending_age),
        str(len(status.fleet)),
    ]


def status_totals(outcomes: list[Outcome[Status]]) -> dict[str, Any]:
    """The totals of ``outbox status`` over many outboxes (those that answered).

    ``relays``: distinct relay ids (a relay serving many outboxes has a
    presence row in each, counted once); ``oldest_pending_age``: the oldest
    of all.
    """
    answered = list(results(outcomes))
    counts: dict[str, int] = {}
    for s in answered:
        for state, n in s.counts.items():
            counts[state] = counts.get(state, 0) + n
    ages = [s.oldest_pending_age for s in answered if s.oldest_pending_age is not None]
    return {
        "outboxes": len(outcomes),
        "failed": len(outcomes) - len(answered),
        "counts": counts,
        "oldest_pending_age": max(ages) if ages else None,
        "created_last_minute": sum(s.created_last_minute for s in answered),
        "sent_last_minute": sum(s.sent_last_minute for s in answered),
        "relays": len({p.relay_id for s in answered for p in s.fleet}),
    }


def render_statuses(outcomes: list[Outcome[Status]], broker: dict[str, Any] | None) -> str:
    """``outbox status`` over many outboxes: a row each, the totals, the last minute."""
    totals = status_totals(outcomes)
    counts = totals["counts"]
    total = [
        str(counts.get("pending", 0)),
        str(counts.get("leased", 0)),
        str(counts.get("dead", 0)),
        format_age(totals["oldest_pending_age"]),
        str(totals["relays"]),
    ]
    lines = [render_table(STATUS_COLUMNS, outcomes, status_cells, total)]
    created, sent = totals["created_last_minute"], totals["sent_last_minute"]
    answered = totals["outboxes"] - totals["failed"]
    lines.append(
        f"{answered} of {totals['outboxes']} outboxes answered; last minute: {created} in, "
        f"{sent} out ({created / 60:.1f}/s in, {sent / 60:.1f}/s out)"
    )
    if broker is not None:
        lines.append(broker_line(broker))
    return "\n".join(lines)


class Progress:
    """A progress bar on a terminal, else a plain line at most every 2 seconds (stderr)."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.bar: Any = None
        self.shown = 0
        self.last_line = 0.0
        self.started = time.monotonic()

    def __call__(self, done: int, total: int) -> None:
        """Show that ``done`` of ``total`` events are copied."""
        if self.tty:
            if self.bar is None:
                self.bar = click.progressbar(
                    length=max(total, 1), label="migrating", file=sys.stderr, show_pos=True
                )
                self.bar.__enter__()
            self.bar.update(done - self.shown)
            self.shown = done
            return
        now = time.monotonic()
        if done and (now - self.last_line >= 2 or done >= total):
            rate = done / max(now - self.started, 1e-9)
            percent = 100 * done / max(total, 1)
            click.echo(
                f"migrate: {done}/{total} events ({percent:.0f}%), {rate:,.0f} events/s",
                err=True,
            )
            self.last_line = now

    def close(self) -> None:
        """End the bar (a no-op without one)."""
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
            self.bar = None
