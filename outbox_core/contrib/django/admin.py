"""The Django admin of the outbox: events read-only, replay of dead ones, inbox records."""

from __future__ import annotations

import uuid
from typing import Any

from django.contrib import admin, messages
from django.db.models import Count, QuerySet
from django.http import HttpRequest
from django.template.response import TemplateResponse

from outbox_core.contrib.django.api import outbox_for
from outbox_core.contrib.django.models import InboxRecord, OutboxEvent
from outbox_core.message import State


class _ReadOnly(admin.ModelAdmin):  # type: ignore[type-arg]
    """Viewable, never added, changed or deleted through the admin."""

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(OutboxEvent)
class OutboxEventAdmin(_ReadOnly):
    """Events with filters (state, topic), search (event id, key), counts per state, replay."""

    list_display = ("id", "topic", "key", "state", "attempts", "created_at", "sent_at", "event_id")
    list_filter = ("state", "topic")
    search_fields = ("key",)
    search_help_text = "An event id, or a key"
    actions = ("replay",)
    list_per_page = 50
    show_full_result_count = False  # a count over a large outbox is slow

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[OutboxEvent], search_term: str
    ) -> tuple[QuerySet[OutboxEvent], bool]:
        """An event id finds its event; anything else is looked up as a key."""
        term = search_term.strip()
        if not term:
            return queryset, False
        try:
            return queryset.filter(event_id=str(uuid.UUID(term))), False
        except ValueError:
            return queryset.filter(key=term), False

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> Any:
        """The changelist with the number of events in each state above it."""
        response = super().changelist_view(request, extra_context)
        if isinstance(response, TemplateResponse) and response.context_data is not None:
            rows = (
                OutboxEvent.objects.using(self._db())
                .values("state")
                .annotate(n=Count("id"))
                .order_by()
            )
            counts = {State(r["state"]).name.lower(): r["n"] for r in rows}
            response.context_data["outbox_counts"] = {
                s.name.lower(): counts.get(s.name.lower(), 0) for s in State
            }
            summary = ", ".join(
                f"{k} {v}" for k, v in response.context_data["outbox_counts"].items()
            )
            response.context_data["title"] = f"Outbox events ({summary})"
        return response

    def get_queryset(self, request: HttpRequest) -> QuerySet[OutboxEvent]:
        """The events on the outbox's database (the router's choice, or settings.OUTBOX)."""
        return super().get_queryset(request).using(self._db())

    def has_replay_permission(self, request: HttpRequest) -> bool:
        """Replaying changes events: the change permission of the model (not given to the admin)."""
        user: Any = request.user
        return bool(user.has_perm("outbox_toolkit.change_outboxevent"))

    @admin.action(description="Replay the selected dead events", permissions=["replay"])
    def replay(self, request: HttpRequest, queryset: QuerySet[OutboxEvent]) -> None:
        """Return the selected dead events to pending (the others are left as they are)."""
        ids = list(queryset.filter(state=int(State.DEAD)).values_list("id", flat=True))
        skipped = queryset.count() - len(ids)
        replayed = outbox_for(self._db()).replay(ids=ids) if ids else 0
        self.message_user(request, f"{replayed} dead event(s) replayed", messages.SUCCESS)
        if skipped:
            self.message_user(
                request, f"{skipped} selected event(s) were not dead and were left as they are"
            )

    @staticmethod
    def _db() -> str:
        from outbox_core.contrib.django.api import outbox_alias

        return outbox_alias()


@admin.register(InboxRecord)
class InboxRecordAdmin(_ReadOnly):
    """Which events each consumer processed (listed only: the table has a two-column key)."""

    list_display = ("consumer", "event_id", "processed_at")
    list_display_links = None
    list_filter = ("consumer",)
    search_fields = ("=event_id",)
