"""The admin: events read-only, filters, search, counts per state, replay of dead events."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import transaction
from django.urls import reverse

from outbox_core.contrib.django import outbox
from outbox_core.contrib.django.models import OutboxEvent

CHANGELIST = "admin:outbox_toolkit_outboxevent_changelist"


def _events() -> list[str]:
    with transaction.atomic():
        ids = [
            outbox.enqueue("orders.created", {"n": 1}, key="order-1"),
            outbox.enqueue("orders.paid", {"n": 2}, key="order-1"),
            outbox.enqueue("orders.created", {"n": 3}, key="order-2"),
        ]
    # The relay gave up on the first two.
    OutboxEvent.objects.filter(event_id__in=ids[:2]).update(state=3, attempts=10, last_error="boom")
    return ids


def test_changelist_counts_filters_and_search(admin_client_db: Any) -> None:
    client = admin_client_db
    ids = _events()
    url = reverse(CHANGELIST)
    page = client.get(url)
    assert page.status_code == 200
    assert page.context["outbox_counts"] == {"pending": 1, "leased": 0, "sent": 0, "dead": 2}
    assert "dead 2" in page.context["title"]
    assert {e.event_id for e in page.context["cl"].result_list} == set(ids)

    def listed(**query: str) -> set[str]:
        response = client.get(url, query)
        assert response.status_code == 200
        return {e.event_id for e in response.context["cl"].result_list}

    assert listed(state="3") == set(ids[:2])
    assert listed(topic="orders.created") == {ids[0], ids[2]}
    assert listed(q=ids[2]) == {ids[2]}
    assert listed(q=ids[2].upper()) == {ids[2]}
    assert listed(q="order-1") == set(ids[:2])
    assert listed(q="nothing") == set()


def test_events_are_read_only(admin_client_db: Any) -> None:
    client = admin_client_db
    _events()
    event = OutboxEvent.objects.order_by("id")[0]
    assert client.get(reverse("admin:outbox_toolkit_outboxevent_add")).status_code == 403
    change = reverse("admin:outbox_toolkit_outboxevent_change", args=[event.pk])
    assert client.get(change).status_code == 200  # viewable
    client.post(change, {"topic": "changed"})
    assert OutboxEvent.objects.get(pk=event.pk).topic == "orders.created"
    delete = reverse("admin:outbox_toolkit_outboxevent_delete", args=[event.pk])
    assert client.post(delete, {"post": "yes"}).status_code == 403
    assert client.get(reverse("admin:outbox_toolkit_inboxrecord_changelist")).status_code == 200


def test_replay_action_returns_the_dead_ones_to_pending(admin_client_db: Any) -> None:
    client = admin_client_db
    ids = _events()
    selected = [str(e.pk) for e in OutboxEvent.objects.all()]  # two dead, one pending
    response = client.post(
        reverse(CHANGELIST),
        {"action": "replay", "_selected_action": selected},
        follow=True,
    )
    assert response.status_code == 200
    text = [str(m) for m in response.context["messages"]]
    assert "2 dead event(s) replayed" in text
    assert "1 selected event(s) were not dead and were left as they are" in text
    rows = {e.event_id: e for e in OutboxEvent.objects.all()}
    assert [rows[i].state for i in ids] == [0, 0, 0]
    assert rows[ids[0]].attempts == 0


@pytest.mark.django_db(transaction=True)
def test_replay_needs_the_change_permission(client: Any, django_user_model: Any) -> None:
    user = django_user_model.objects.create_user("viewer", password="pw", is_staff=True)
    from django.contrib.auth.models import Permission

    user.user_permissions.add(Permission.objects.get(codename="view_outboxevent"))
    client.force_login(user)
    ids = _events()
    page = client.get(reverse(CHANGELIST))
    assert page.status_code == 200
    assert "replay" not in page.context["cl"].model_admin.get_actions(page.wsgi_request)
    client.post(
        reverse(CHANGELIST),
        {"action": "replay", "_selected_action": [str(e.pk) for e in OutboxEvent.objects.all()]},
    )
    assert OutboxEvent.objects.get(event_id=ids[0]).state == 3
