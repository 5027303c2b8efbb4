"""Wake-ups: NOTIFY in the transaction on PostgreSQL, in-process relays at commit."""

from __future__ import annotations

import select
import time
from typing import Any
from unittest import mock

import pytest
from django.db import connections, transaction

from outbox_core.contrib.django import outbox, outbox_for

pytestmark = pytest.mark.django_db(transaction=True)


def test_in_process_relays_are_woken_at_commit_only() -> None:
    relay = outbox_for().relay("memory://")
    try:
        with mock.patch.object(relay, "wake") as wake:
            with pytest.raises(RuntimeError), transaction.atomic():
                outbox.enqueue("t.gone", {})
                raise RuntimeError
            assert wake.call_count == 0
            with transaction.atomic():
                outbox.enqueue("t.kept", {})
                outbox.enqueue("t.kept", {})
                assert wake.call_count == 0  # not before the commit
            assert wake.call_count == 1
    finally:
        relay.close()


class _Listener:
    """LISTEN on a connection of the driver Django uses (psycopg 3 or psycopg2)."""

    def __init__(self, channel: str) -> None:
        from django.db.backends.postgresql.psycopg_any import is_psycopg3

        from outbox_core.contrib.django.databases import database_url

        url = database_url("default")
        dsn = url.set(drivername="postgresql").render_as_string(hide_password=False)
        if is_psycopg3:
            import psycopg

            self.conn: Any = psycopg.connect(dsn, autocommit=True)
        else:
            import psycopg2

            self.conn = psycopg2.connect(dsn)
            self.conn.autocommit = True
        self.v3 = is_psycopg3
        cursor = self.conn.cursor()
        cursor.execute(f'LISTEN "{channel}"')
        cursor.close()

    def wait(self, timeout: float) -> list[str]:
        if self.v3:
            return [n.channel for n in self.conn.notifies(timeout=timeout, stop_after=1)]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            select.select([self.conn], [], [], max(0.0, deadline - time.monotonic()))
            self.conn.poll()
            if self.conn.notifies:
                return [self.conn.notifies.pop(0).channel]
        return []

    def close(self) -> None:
        self.conn.close()


def test_postgresql_notify_is_sent_with_the_commit(vendor: str) -> None:
    if vendor != "postgresql":
        pytest.skip("NOTIFY is PostgreSQL's")
    channel = outbox_for().dialect.enqueue.notify_channel()
    listener = _Listener(channel)
    try:
        with pytest.raises(RuntimeError), transaction.atomic():
            outbox.enqueue("t.gone", {})
            raise RuntimeError
        assert listener.wait(1) == []
        with transaction.atomic():
            with pytest.raises(RuntimeError), transaction.atomic():
                outbox.enqueue("t.savepoint", {})  # its NOTIFY goes with the savepoint
                raise RuntimeError
            outbox.enqueue("t.kept", {})  # so this one sends it again
            assert listener.wait(0.5) == []  # not before the commit
        assert listener.wait(5) == [channel]
    finally:
        listener.close()
        connections.close_all()
