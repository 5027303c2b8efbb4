"""The dashboard's URLs: ``path("ops/outbox/", include("outbox_core.contrib.django.urls"))``.

Every path below the prefix goes to :func:`~outbox_core.contrib.django.dashboard.dashboard`
(pages, the JSON API, replays, static files); ``reverse("outbox_dashboard:index")``
is the overview.
"""

from __future__ import annotations

from django.urls import path, re_path

from outbox_core.contrib.django.dashboard import dashboard

app_name = "outbox_dashboard"

urlpatterns = [
    path("", dashboard, name="index"),
    re_path(r"^(?P<subpath>.+)$", dashboard, name="page"),
]
