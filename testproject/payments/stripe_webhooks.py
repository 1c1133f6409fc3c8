"""Stripe webhooks: the signature checked by DRF authentication, the event's id as the key.

Stripe signs each delivery attempt with the endpoint's secret:
``Stripe-Signature: t=<unix time>,v1=<hex HMAC-SHA256 of "<t>.<raw body>">``
(a ``v1`` per active secret while one is being rolled). The authentication
class checks it before DRF runs the handler, and so before the claim: a
forged request is refused with 401 and stores nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth.models import AnonymousUser
from rest_framework.authentication import BaseAuthentication
from rest_framework.exceptions import AuthenticationFailed
from rest_framework.parsers import JSONParser
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from django_idempotency import idempotent
from payments.models import WebhookEvent

#: Seconds a signature stays acceptable: Stripe's own libraries use five minutes.
TOLERANCE = 300


def stripe_signature(payload: bytes, secret: str, timestamp: int) -> str:
    """The ``v1`` signature of ``payload`` sent at ``timestamp``."""
    signed = str(timestamp).encode() + b"." + payload
    return hmac.new(secret.encode(), signed, hashlib.sha256).hexdigest()


class StripeSignatureAuthentication(BaseAuthentication):
    """Accept only requests signed with ``settings.STRIPE_WEBHOOK_SECRET``."""

    def authenticate(self, request: Request) -> tuple[AnonymousUser, str]:
        header = request.headers.get("Stripe-Signature", "")
        pairs = [item.split("=", 1) for item in header.split(",") if "=" in item]
        timestamps = [value for name, value in pairs if name.strip() == "t"]
        signatures = [value for name, value in pairs if name.strip() == "v1"]
        if len(timestamps) != 1 or not timestamps[0].isdigit() or not signatures:
            raise AuthenticationFailed("A valid Stripe-Signature header is required.")
        timestamp = int(timestamps[0])
        if abs(time.time() - timestamp) > TOLERANCE:
            raise AuthenticationFailed("The Stripe-Signature timestamp is too old.")
        # request.body: the raw bytes, read before DRF parses them.
        expected = stripe_signature(request.body, settings.STRIPE_WEBHOOK_SECRET, timestamp)
        if not any(hmac.compare_digest(expected.encode(), s.encode()) for s in signatures):
            raise AuthenticationFailed("The Stripe-Signature does not match the body.")
        # request.auth names the verified sender: the records' tenant below.
        return AnonymousUser(), "stripe"

    def authenticate_header(self, request: Request) -> str:
        return "Stripe-Signature"  # makes the refusal a 401, not a 403


def verified_sender(request: Request) -> str:
    return str(request.auth)


class StripeWebhookView(APIView):
    authentication_classes = [StripeSignatureAuthentication]
    permission_classes: list[Any] = []  # the signature is the permission
    parser_classes = [JSONParser]

    # key: the event's id, the same on every delivery attempt of one event.
    # fingerprint: the id and type only; Stripe's payload may change between
    # attempts (pending_webhooks), and a 422 would be redelivered forever.
    # ttl: Stripe retries a delivery for up to three days.
    @idempotent(
        key="body:id",
        fingerprint=["id", "type"],
        tenant=verified_sender,
        ttl=timedelta(days=3),
    )
    def post(self, request: Request) -> Response:
        event = dict(request.data)  # a JSON object: it had an "id" to claim
        WebhookEvent.objects.create(source="stripe", delivery=event["id"], kind=event["type"])
        return Response({"received": True})
