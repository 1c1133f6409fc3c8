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
