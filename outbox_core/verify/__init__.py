"""``outbox verify``: prove the outbox's guarantees on your own database server.

Each guarantee is checked against the server the URL names, on temporary
tables (``outbox_verify_<random>``) created for the check and dropped after
it; the real outbox table is never read or written. Concurrency is real:
separate connections, and threads that claim at the same time. The result is
one row of a compatibility matrix (the server, its version, each guarantee
as pass, fail or skip with the reason, and the time), printed as text, JSON
or JUnit XML. ``verify`` exits 1 when any guarantee fails.

The checks use only the dialect interface, so a broken strategy (a claim
without SKIP LOCKED, an ordered claim without its head-of-key check, relay
connections without server-side limits) fails the guarantee it breaks, by
name.

Modules: :mod:`~outbox_core.verify.model` (verdicts and the matrix row),
:mod:`~outbox_core.verify.harness` (the :class:`Context` a check runs on, its
temporary tables and threads), :mod:`~outbox_core.verify.checks` (the
guarantees), :mod:`~outbox_core.verify.runner` (:func:`verify`),
:mod:`~outbox_core.verify.render` (text, JSON, JUnit),
:mod:`~outbox_core.verify.machine` (the hypothesis state machine, also run by
``tests/property``), :mod:`~outbox_core.verify.crash` (the SIGKILL run of
``outbox relay`` processes), :mod:`~outbox_core.verify.wal` (the log-tailing
rows, on a temporary publication and replication slot),
:mod:`~outbox_core.verify.sink` (the file broker those processes publish to)
and :mod:`~outbox_core.verify.matrix` (rows merged into one Markdown matrix:
``outbox matrix``, ``compat_matrix``).
"""

from __future__ import annotations

from outbox_core.verify.checks import GUARANTEES
from outbox_core.verify.harness import Context, expect, needs_ordered_claims
from outbox_core.verify.model import Failed, Report, Result, Skip
from outbox_core.verify.render import render_json, render_junit, render_text
from outbox_core.verify.runner import verify

__all__ = [
    "GUARANTEES",
    "Context",
    "Failed",
    "Report",
    "Result",
    "Skip",
    "expect",
    "needs_ordered_claims",
    "render_json",
    "render_junit",
    "render_text",
    "verify",
]
