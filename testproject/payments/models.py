"""A toy payments domain: the side effects the idempotency layer protects."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone


class Payment(models.Model):
    """A charge for one of the owner's orders. Amounts are in minor units (cents)."""

    class Status(models.TextChoices):
        SUCCEEDED = "succeeded", "succeeded"
        PARTIALLY_REFUNDED = "partially_refunded", "partially refunded"
        REFUNDED = "refunded", "refunded"

    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="payments"
    )
    order_id = models.CharField(max_length=64)
    amount = models.PositiveBigIntegerField(help_text="In minor units, e.g. cents.")
    currency = models.CharField(max_length=3)
    status = models.CharField(max_length=32, choices=Status.choices, default=Status.SUCCEEDED)
    provider_charge_id = models.CharField(
        max_length=64,
        blank=True,
        default="",
        help_text="The payment provider's id of the charge that paid this order.",
    )
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["id"]
        constraints = [
            # The domain guard, a second line of defence behind the
            # Idempotency-Key: even a client that sends a fresh key (or none)
            # cannot pay the same order twice. Order ids are the owner's own
            # references, so two owners may each have an order "A-1".
            models.UniqueConstraint(
                fields=["owner", "order_id"], name="payments_one_payment_per_order"
            ),
            models.CheckConstraint(
                condition=models.Q(amount__gt=0), name="payments_payment_amount_positive"
            ),
        ]

    def __str__(self) -> str:
        return f"Payment {self.pk} for order {self.order_id}: {self.amount} {self.currency}"


class Refund(models.Model):
    payment = models.ForeignKey(Payment, on_delete=models.PROTECT, related_name="refunds")
    amount = models.PositiveBigIntegerField(help_text="In minor units, e.g. cents.")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["id"]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(amount__gt=0), name="payments_refund_amount_positive"
            ),
        ]

    def __str__(self) -> str:
        return f"Refund {self.pk} of payment {self.payment_id}: {self.amount}"


class WebhookEvent(models.Model):
    """One run of a webhook handler: a redelivery that ran again would be a second row."""

    source = models.CharField(max_length=16)
    delivery = models.CharField(max_length=255, help_text="The sender's event or delivery id.")
    kind = models.CharField(max_length=64, blank=True, default="")
    received_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["id"]

    def __str__(self) -> str:
        return f"{self.source} {self.kind} {self.delivery}"
