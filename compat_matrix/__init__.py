"""The project's compatibility matrix, built on ``outbox verify`` (the kit users run).

``python -m compat_matrix`` runs ``outbox verify --json`` (the installed
command, in a subprocess each) against a temporary SQLite file and every
configured server::

    python -m compat_matrix \\
        --postgresql postgresql+psycopg://postgres@127.0.0.1:5432/test \\
        --mysql mysql+pymysql://root@127.0.0.1:3306/test

URLs come from the flags (repeatable, for several versions of one database)
or from ``OUTBOX_TEST_POSTGRESQL_URL`` / ``OUTBOX_TEST_MYSQL_URL`` /
``OUTBOX_TEST_MSSQL_URL``. ``--quick`` / ``--thorough`` pass through to
``verify``. It writes ``matrix.json`` (the verify rows, with the
environment) and ``MATRIX.md`` (``--out``, default this directory), whose
table is rendered by :mod:`outbox_core.verify.matrix`, the code behind
``outbox matrix``. The exit code is 1 when a guarantee failed on a server,
or a server could not be verified at all (unreachable, unsupported).
``python -m compat_matrix merge A.json B.json`` merges the ``matrix.json``
of several runs (one per CI job) into one matrix.
"""
