"""The outbox in Django: an app, ``outbox.enqueue`` inside ``transaction.atomic()``, the inbox.

``INSTALLED_APPS = [..., "outbox_core.contrib.django"]`` then ``manage.py
migrate`` creates the tables; ``manage.py outbox relay`` publishes. See
docs/django.md.
"""

from __future__ import annotations

from outbox_core.contrib.django.api import DjangoInbox, DjangoOutbox, inbox, outbox, outbox_for

__all__ = ["DjangoInbox", "DjangoOutbox", "inbox", "outbox", "outbox_for"]
