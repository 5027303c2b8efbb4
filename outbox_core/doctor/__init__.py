"""``outbox doctor``: check a database's outbox set-up and explain how to fix each finding.

>>> findings = diagnose(Outbox("postgresql+psycopg://app@db/app"))
>>> print(render_report(findings))

Each check gives one or more :class:`Finding` with a severity (``ok``,
``warning``, ``error``), what was found, why it matters, and the fix
(``CREATE INDEX`` compiled for the database, the setting to change, the
command to run):

* ``connection``: the database answers;
* ``version``: server version and how claims skip each other's rows (SKIP
  LOCKED, READPAST, SQLite's single writer), via the dialect's own check;
* ``isolation``: the level claims run at (PostgreSQL's default; MySQL's
  server default versus the READ COMMITTED the relay sets per connection, and
  a binary log format that refuses it; SQL Server's READ_COMMITTED_SNAPSHOT);
* ``tables``: the outbox and inbox tables exist, on InnoDB for MySQL, with
  the inbox's primary key;
* ``index``: every index of ``outbox_core/schema.py`` is there, compared by
  column list;
* ``journal_mode``: SQLite runs in WAL mode;
* ``dead_tuples`` and ``long_transactions``: PostgreSQL's dead row versions
  and the open transactions that keep vacuum from removing them (MySQL and
  MariaDB: long InnoDB transactions, which hold back purge);
* ``backlog`` and ``dead_events``: how long the oldest due event has waited,
  and dead events per topic.

A check that cannot run (no permission on a catalog view) is a warning that
says so; it never stops the others. The command exits 0 when healthy, 1 on an
error (or a warning with ``--strict``), 2 when its own arguments are wrong.
"""

from outbox_core.doctor.checks import diagnose, expected_indexes
from outbox_core.doctor.family import Check, FamilyDoctor
from outbox_core.doctor.model import DoctorContext, Finding, Severity, Thresholds
from outbox_core.doctor.report import exit_code, render_report, report_dict

__all__ = [
    "Check",
    "DoctorContext",
    "FamilyDoctor",
    "Finding",
    "Severity",
    "Thresholds",
    "diagnose",
    "exit_code",
    "expected_indexes",
    "render_report",
    "report_dict",
]
