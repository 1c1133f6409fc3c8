from __future__ import annotations

from django.db import models
from django.utils import timezone


class Payment(models.Model):
    """The business write every endpoint makes: one row per execution."""

    amount = models.BigIntegerField()
    currency = models.CharField(max_length=3)
    created_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return f"{self.amount} {self.currency}"


class FloorRecord(models.Model):
    """The hand-written "floor" design's records (written by raw SQL in views.floor).

    What a minimal correct design needs: the scope under a unique constraint
    (the claim's arbiter), a fingerprint (refuse a reused key), a state (tell
    a finished operation from one in flight), the stored answer, and an
    expiry with an index (retention has to be purged somehow).
    """

    tenant = models.CharField(max_length=128)
    operation = models.CharField(max_length=255)
    key = models.CharField(max_length=255)
    fingerprint = models.CharField(max_length=64)
    state = models.CharField(max_length=16)
    response_status = models.SmallIntegerField(null=True)
    response_location = models.CharField(max_length=255, blank=True, default="")
    response_body = models.BinaryField(null=True)
    created_at = models.DateTimeField()
    expires_at = models.DateTimeField(db_index=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "operation", "key"], name="benchapp_floor_scope"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.operation} {self.key!r} ({self.state})"
