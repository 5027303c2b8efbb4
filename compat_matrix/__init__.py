"""Compatibility matrix: the conformance suites run per database, rendered as one table.

``python -m compat_matrix`` runs the dialect contract (``tests/contract``), the
broker suite (``tests/contract/test_brokers.py``) and the property suite
(``tests/property``) against SQLite and every configured server::

    python -m compat_matrix \\
        --postgresql postgresql+psycopg://postgres@127.0.0.1:5433/test \\
        --postgresql postgresql+psycopg://postgres@127.0.0.1:5434/test \\
        --mysql mysql+pymysql://root@127.0.0.1:3306/test

URLs come from the flags (repeatable, for several versions of one database)
or from ``OUTBOX_TEST_POSTGRESQL_URL`` / ``OUTBOX_TEST_MYSQL_URL`` /
``OUTBOX_TEST_MSSQL_URL``. For each database it records the server's product
and version (MariaDB told from MySQL) and names the column after them, then
runs each suite in its own pytest subprocess with that URL and
``OUTBOX_TEST_BACKENDS=<backend>``, recording every test's outcome.

It writes ``MATRIX.md`` and ``matrix.json`` (``--out``, default this
directory): rows are the features of :data:`compat_matrix.features.FEATURES`
(plus an "other tests" row per suite for unmapped tests), columns the
databases, cells pass / fail / partial / not run with the reason. The exit
code is 1 when any cell failed. ``python -m compat_matrix merge A.json B.json``
combines the results of several runs (one per CI job) into one matrix.

Modules: :mod:`~compat_matrix.features` (the row-to-test mapping),
:mod:`~compat_matrix.probe` (server versions, environment),
:mod:`~compat_matrix.runner` (the pytest subprocesses),
:mod:`~compat_matrix.pytest_plugin` (per-test recording),
:mod:`~compat_matrix.cells` (verdicts), :mod:`~compat_matrix.render` (output),
:mod:`~compat_matrix.cli` (the command).
"""
