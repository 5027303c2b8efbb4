from django.contrib import admin
from django.urls import path

from tests.django.project import webhooks

urlpatterns = [
    path("admin/", admin.site.urls),
    # docs/examples/consumers/webhook_django.py (tests/django/project/webhook_tests.py)
    path("webhooks/orders/", webhooks.receive_order_event),
]
