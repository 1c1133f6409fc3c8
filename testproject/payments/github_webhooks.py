"""GitHub webhooks: a plain Django view, its signature checked by ``verify=``.

GitHub signs the raw body with the webhook's secret:
``X-Hub-Signature-256: sha256=<hex HMAC-SHA256 of the body>``, and no
header: not ``X-GitHub-Delivery``, the delivery's GUID, nor
``X-GitHub-Event``. So the key is the digest of the signed body, which a
redelivery repeats byte for byte, and which nobody can pair with another
body: the GUID would let anyone holding one signed body send it again under
new GUIDs, or first under the GUID of a delivery GitHub is about to
redeliver. ``verify`` runs before the key is read and claimed: a forged
request gets 401 and stores nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from datetime import timedelta

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from django_idempotency import idempotent
from payments.models import WebhookEvent


def github_signature(payload: bytes, secret: str) -> str:
    """The ``X-Hub-Signature-256`` value of ``payload``."""
    return "sha256=" + hmac.new(secret.encode(), payload, hashlib.sha256).hexdigest()


def verify_github_signature(request: HttpRequest) -> HttpResponse | None:
    """None if GitHub signed the body with ``settings.GITHUB_WEBHOOK_SECRET``; else a 401."""
    expected = github_signature(request.body, settings.GITHUB_WEBHOOK_SECRET)
    sent = request.headers.get("X-Hub-Signature-256", "")
    if not hmac.compare_digest(expected.encode(), sent.encode()):
        return HttpResponse("Invalid X-Hub-Signature-256.", status=401)
    return None


def github(request: HttpRequest) -> str:
    return "github"


@csrf_exempt  # the signature stands for the CSRF token
@idempotent(
    key="digest:body",  # what the signature covers: the raw body, byte for byte
    fingerprint=[],  # the key stands for the whole body; the query string is unsigned
    verify=verify_github_signature,
    tenant=github,
    ttl=timedelta(days=3),  # GitHub redelivers deliveries of the past three days
)
def github_webhook(request: HttpRequest) -> JsonResponse:
    if request.method != "POST":
        return JsonResponse({"detail": "POST only."}, status=405)
    event = json.loads(request.body)
    WebhookEvent.objects.create(
        source="github",
        delivery=request.headers.get("X-GitHub-Delivery", ""),  # for the log only: unsigned
        kind=request.headers.get("X-GitHub-Event", "") + ":" + str(event.get("action", "")),
    )
    return JsonResponse({"received": True})
