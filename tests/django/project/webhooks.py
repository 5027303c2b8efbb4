"""The webhook receiver of docs/consumers.md, served by the test project.

``docs/examples/consumers/webhook_django.py`` is loaded by path (``docs`` is
not a package) and its view routed at ``/webhooks/orders/`` (``urls.py``).
"""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "docs/examples/consumers/webhook_django.py"

_spec = importlib.util.spec_from_file_location("webhook_django", EXAMPLE)
assert _spec is not None and _spec.loader is not None
webhook_django = importlib.util.module_from_spec(_spec)
sys.modules["webhook_django"] = webhook_django
_spec.loader.exec_module(webhook_django)

#: ``POST /webhooks/orders/``
receive_order_event = webhook_django.receive_order_event
