from django.apps import AppConfig


class OrdersConfig(AppConfig):
    name = "tests.django.project.orders"
    label = "orders"
