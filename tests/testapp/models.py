from django.db import models


class Charge(models.Model):
    """A side effect the protected test views perform: one row per execution."""

    tenant = models.CharField(max_length=128)
    amount = models.IntegerField()
    note = models.CharField(max_length=200, blank=True)
    refunded = models.BooleanField(default=False)

    class Meta:
        app_label = "testapp"

    def __str__(self) -> str:
        return f"Charge {self.pk} of {self.amount} for {self.tenant}"


class Order(models.Model):
    """A business row with a unique key of its own: duplicates of one request collide on it.

    The optimistic mode's tests make a view write one per request, numbered
    from the body, so that a concurrent duplicate fails in the view body on
    this unique constraint before it reaches the record's INSERT.
    """

    number = models.CharField(max_length=64, unique=True)
    amount = models.IntegerField()

    class Meta:
        app_label = "testapp"

    def __str__(self) -> str:
        return f"Order {self.number}"
