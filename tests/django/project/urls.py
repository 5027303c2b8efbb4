from django.contrib import admin
from django.urls import include, path

from tests.django.project import webhooks

urlpatterns = [
    path("admin/", admin.site.urls),
    # docs/django.md "The dashboard" (tests/django/suite/test_dashboard.py)
    path("ops/outbox/", include("outbox_core.contrib.django.urls")),
    # docs/examples/consumers/webhook_django.py (tests/django/project/webhook_tests.py)
    path("webhooks/orders/", webhooks.receive_order_event),
]
