"""The orders example of docs/django.md."""

from django.db import models


class Customer(models.Model):
    name = models.CharField(max_length=100)


class Order(models.Model):
    # Django's foreign keys are DEFERRABLE INITIALLY DEFERRED on PostgreSQL:
    # a missing customer fails at COMMIT, after the event was written.
    customer = models.ForeignKey(Customer, on_delete=models.PROTECT)
    total = models.DecimalField(max_digits=10, decimal_places=2)
    created_at = models.DateTimeField(auto_now_add=True)


class Invoice(models.Model):
    """What the billing consumer makes of an orders.created event."""

    order_id = models.BigIntegerField(unique=True)
    total = models.DecimalField(max_digits=10, decimal_places=2)
