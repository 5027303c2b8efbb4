"""The dashboard at /ops/outbox/ (contrib.django.urls): staff only, replays by permission.

The console app reads and replays through the outbox's own engine, so the
events are committed first (a transactional database per test).
"""

from __future__ import annotations

import re
from html import unescape
from pathlib import Path
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.contrib.auth.models import Permission
from django.core.exceptions import ImproperlyConfigured
from django.db import connections, transaction
from django.test import Client, override_settings

import outbox_core.console
from outbox_core.contrib.django import outbox
from outbox_core.contrib.django.conf import outbox_settings
from outbox_core.contrib.django.models import OutboxEvent

pytestmark = pytest.mark.django_db(transaction=True)

BASE = "/ops/outbox"
STATIC = Path(outbox_core.console.__file__).parent / "static"


def _events() -> list[str]:
    with transaction.atomic():
        ids = [
            outbox.enqueue("orders.created", {"n": 1}, key="order-1"),
            outbox.enqueue("orders.paid", {"n": 2}, key="order-1"),
            outbox.enqueue("orders.created", {"n": 3}, key="order-2"),
            outbox.enqueue("orders.created", {"n": 4}, key="order-3"),
        ]
    # The relay gave up on the first two and holds the last.
    OutboxEvent.objects.filter(event_id__in=ids[:2]).update(state=3, attempts=10, last_error="boom")
    OutboxEvent.objects.filter(event_id=ids[3]).update(state=1, lease_owner="relay-1")
    return ids


def _login(client: Any, user_model: Any, *codenames: str, staff: bool = True) -> Any:
    user = user_model.objects.create_user("operator", password="pw", is_staff=staff)
    for codename in codenames:
        user.user_permissions.add(
            Permission.objects.get(codename=codename, content_type__app_label="outbox_toolkit")
        )
    client.force_login(user)
    return client


def _csrf(client: Any) -> str:
    """The console's CSRF token: its cookie, set by the first page, scoped to the prefix."""
    page = client.get(f"{BASE}/events?state=dead")
    assert page.status_code == 200
    cookie = client.cookies["outbox_csrf"]
    assert cookie["path"] == BASE and cookie["httponly"]
    assert f'name="csrf" value="{cookie.value}"' in page.content.decode()
    return str(cookie.value)


def _state(event_id: str) -> int:
    return int(OutboxEvent.objects.get(event_id=event_id).state)


def _count(html: str, state: str) -> int:
    found = re.search(rf'id="count-{state}"[^>]*>(\d+)<', html)
    assert found is not None, f"no {state} count in the page"
    return int(found.group(1))


def test_anonymous_users_are_sent_to_the_admin_login(client: Any) -> None:
    for url in (f"{BASE}/", f"{BASE}/api/overview", f"{BASE}/static/console.js"):
        answer = client.get(url)
        assert answer.status_code == 302
        assert answer["Location"].startswith("/admin/login/?next=")
    assert client.post(f"{BASE}/replay", {"ids": "1"}).status_code == 302


def test_users_who_are_not_staff_or_lack_the_permission_get_403(
    client: Any, django_user_model: Any
) -> None:
    ids = _events()
    _login(client, django_user_model, "change_outboxevent", staff=False)
    assert client.get(f"{BASE}/").status_code == 403
    assert client.post(f"{BASE}/replay", {"ids": "1"}).status_code == 403
    # Staff, but no permission on outbox events: the payloads are not theirs to read.
    django_user_model.objects.filter(username="operator").update(is_staff=True)
    django_user_model.objects.get(username="operator").user_permissions.clear()
    assert client.get(f"{BASE}/").status_code == 403
    assert _state(ids[0]) == 3


def test_staff_see_the_overview_with_the_counts(admin_client_db: Any) -> None:
    _events()
    page = admin_client_db.get(f"{BASE}/")
    assert page.status_code == 200
    assert page["Content-Type"].startswith("text/html")
    assert "script-src 'self'" in page["Content-Security-Policy"]
    html = page.content.decode()
    assert (_count(html, "pending"), _count(html, "leased"), _count(html, "dead")) == (1, 1, 2)
    api = admin_client_db.get(f"{BASE}/api/overview")
    assert api.status_code == 200
    assert {k: api.json()[k] for k in ("pending", "leased", "dead")} == {
        "pending": 1,
        "leased": 1,
        "dead": 2,
    }
    dead = admin_client_db.get(f"{BASE}/events", {"state": "dead"})
    assert dead.status_code == 200 and dead.content.decode().count("orders.") >= 2


def test_links_in_the_pages_stay_under_the_prefix(admin_client_db: Any) -> None:
    _events()
    event = OutboxEvent.objects.filter(state=3).order_by("id")[0]
    for url in ("/", "/relays", "/events?state=dead", f"/events/{event.pk}", "/held"):
        page = admin_client_db.get(f"{BASE}{url}")
        assert page.status_code == 200, url
        html = page.content.decode()
        assert f'data-base="{BASE}"' in html
        links = re.findall(r'(?:href|src|action)="([^"]*)"', html)
        assert links, url
        outside = [link for link in links if not (link.startswith(f"{BASE}/") or link == "data:,")]
        assert not outside, f"{url}: {outside}"


def test_static_files_are_served(admin_client_db: Any) -> None:
    answer = admin_client_db.get(f"{BASE}/static/console.js")
    assert answer.status_code == 200
    assert "javascript" in answer["Content-Type"]
    assert answer.content == (STATIC / "console.js").read_bytes()
    assert answer["X-Content-Type-Options"] == "nosniff"
    assert admin_client_db.get(f"{BASE}/static/nothing.js").status_code == 404


def test_staff_without_the_change_permission_cannot_replay(
    client: Any, django_user_model: Any
) -> None:
    ids = _events()
    _login(client, django_user_model, "view_outboxevent")
    page = client.get(f"{BASE}/")
    assert page.status_code == 200 and 'id="read-only"' in page.content.decode()
    answer = client.post(f"{BASE}/replay", {"ids": str(_pk(ids[0])), "csrf": _csrf(client)})
    assert answer.status_code == 403
    assert _state(ids[0]) == 3


def _pk(event_id: str) -> int:
    return int(OutboxEvent.objects.get(event_id=event_id).pk)


def test_staff_with_the_change_permission_replay(django_user_model: Any) -> None:
    ids = _events()
    # Django's CSRF check enforced, as for a browser: the console's own token is what counts.
    client = Client(enforce_csrf_checks=True)
    _login(client, django_user_model, "change_outboxevent")
    assert 'id="read-only"' not in client.get(f"{BASE}/").content.decode()
    answer = client.post(
        f"{BASE}/replay",
        {"ids": str(_pk(ids[0])), "csrf": _csrf(client), "back": "/events?state=dead"},
    )
    assert answer.status_code == 303
    assert answer["Location"] == f"{BASE}/events?state=dead&replayed=1"
    assert _state(ids[0]) == 0
    assert _state(ids[1]) == 3
    # A script asks for JSON; a key replays its dead events.
    answer = client.post(
        f"{BASE}/replay",
        {"key": "order-1", "csrf": _csrf(client)},
        HTTP_ACCEPT="application/json",
    )
    assert answer.status_code == 200 and answer.json() == {"replayed": 1}
    assert _state(ids[1]) == 0


def test_a_change_without_the_consoles_csrf_token_is_refused_even_for_a_superuser(
    admin_client_db: Any,
) -> None:
    client = admin_client_db
    ids = _events()
    pk = str(_pk(ids[0]))
    csrf = _csrf(client)
    assert client.post(f"{BASE}/replay", {"ids": pk}).status_code == 403
    assert client.post(f"{BASE}/replay", {"ids": pk, "csrf": "forged"}).status_code == 403
    elsewhere = client.post(
        f"{BASE}/replay", {"ids": pk, "csrf": csrf}, HTTP_ORIGIN="https://evil.example"
    )
    assert elsewhere.status_code == 403
    assert _state(ids[0]) == 3
    same = client.post(f"{BASE}/replay", {"ids": pk, "csrf": csrf}, HTTP_ORIGIN="http://testserver")
    assert same.status_code == 303
    assert _state(ids[0]) == 0


def test_atomic_requests_do_not_stop_the_async_view(
    admin_client_db: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _events()
    monkeypatch.setitem(connections.settings["default"], "ATOMIC_REQUESTS", True)
    assert admin_client_db.get(f"{BASE}/").status_code == 200


def test_the_dashboard_runs_under_djangos_asgi_handler(
    async_client: Any, django_user_model: Any
) -> None:
    _events()
    async_client.force_login(django_user_model.objects.create_superuser("root", "r@x.org", "pw"))

    async def get(url: str) -> Any:
        return await async_client.get(url)

    page = async_to_sync(get)(f"{BASE}/")
    assert page.status_code == 200
    assert _count(page.content.decode(), "dead") == 2
    script = async_to_sync(get)(f"{BASE}/static/console.js")
    assert script.content == (STATIC / "console.js").read_bytes()


def test_the_dashboard_settings(admin_client_db: Any, settings: Any) -> None:
    ids = _events()
    url = f"{BASE}/events/{_pk(ids[0])}"

    def payload() -> str:
        html = admin_client_db.get(url).content.decode()
        found = re.search(r'<pre id="event-payload">(.*?)</pre>', html, re.S)
        assert found is not None
        return unescape(found.group(1))

    assert '"n": 1' in payload()
    settings.OUTBOX = {**settings.OUTBOX, "DASHBOARD": {"HIDE_PAYLOADS": True, "REFRESH": "2s"}}
    assert outbox_settings().dashboard.refresh == 2.0
    assert payload() == "hidden (--hide-payloads)"
    assert 'data-refresh="2.0"' in admin_client_db.get(f"{BASE}/").content.decode()


@pytest.mark.parametrize(
    ("dashboard", "named"),
    [
        ({"HIDE": True}, "HIDE"),
        ({"REFRESH": "soon"}, "REFRESH"),
        ({"REFRESH": 0.1}, "REFRESH"),
        ({"HIDE_PAYLOADS": "maybe"}, "HIDE_PAYLOADS"),
        ("yes", "must be a dict"),
    ],
)
def test_bad_dashboard_settings_are_refused_by_name(dashboard: Any, named: str) -> None:
    with (
        override_settings(OUTBOX={"DASHBOARD": dashboard}),
        pytest.raises(ImproperlyConfigured, match=named),
    ):
        outbox_settings()
