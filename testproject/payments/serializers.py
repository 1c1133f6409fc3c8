from __future__ import annotations

from typing import Any

from rest_framework import serializers

from payments.models import Payment, Refund


class PaymentSerializer(serializers.ModelSerializer[Payment]):
    class Meta:
        model = Payment
        fields = ["id", "order_id", "amount", "currency", "status", "created_at"]
        read_only_fields = ["id", "status", "created_at"]
        extra_kwargs: dict[str, Any] = {"amount": {"min_value": 1}}
        # No uniqueness pre-check: the database constraint is the guard, and
        # the view turns its violation into 409 order_already_paid.
        validators: list[Any] = []

    def validate_currency(self, value: str) -> str:
        code = value.upper()
        if len(code) != 3 or not code.isascii() or not code.isalpha():
            raise serializers.ValidationError("Use a three-letter ISO 4217 code, e.g. EUR.")
        return code


class RefundSerializer(serializers.ModelSerializer[Refund]):
    class Meta:
        model = Refund
        fields = ["id", "payment", "amount", "created_at"]
        read_only_fields = ["id", "payment", "created_at"]
        extra_kwargs: dict[str, Any] = {"amount": {"min_value": 1}}
