"""``python manage.py consume_orders``: bill each orders.created event from RabbitMQ."""

import json
import signal
from typing import Any

import pika
from django.conf import settings
from django.core.management.base import BaseCommand

from tests.django.project.orders.consumers import bill_order


class Command(BaseCommand):
    help = "Consume orders.created events and bill each order once."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--exchange", default="orders")
        parser.add_argument("--queue", default="billing")

    def handle(self, *args: Any, exchange: str, queue: str, **options: Any) -> None:
        connection = pika.BlockingConnection(pika.URLParameters(settings.OUTBOX["BROKER_URL"]))
        channel = connection.channel()
        channel.exchange_declare(exchange, "topic", durable=True)
        channel.queue_declare(queue, durable=True)
        channel.queue_bind(queue, exchange, "orders.created")

        def on_message(ch: Any, method: Any, properties: Any, body: bytes) -> None:
            bill_order(properties.message_id, json.loads(body))
            ch.basic_ack(method.delivery_tag)  # after the commit

        channel.basic_consume(queue, on_message)
        signal.signal(signal.SIGTERM, lambda *_: channel.stop_consuming())
        channel.start_consuming()
        connection.close()
