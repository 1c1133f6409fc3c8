"""The demo project's webhook endpoints, the code docs/webhooks-*.md show.

Correctly signed and forged deliveries are posted through the documented
code (``testproject/payments/stripe_webhooks.py`` and ``github_webhooks.py``,
which the pages include verbatim: the last tests check that). A handler run
is a ``WebhookEvent`` row. The same with real processes, five deliveries at
once and a redelivery an hour later: ``tests/live/test_webhooks_live.py``.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from django.apps import apps
from django.conf import settings
from django.test import Client

if not apps.is_installed("payments"):
    pytest.skip("the demo project's app is not installed", allow_module_level=True)

from payments.github_webhooks import github_signature
from payments.models import WebhookEvent
from payments.stripe_webhooks import stripe_signature

from django_idempotency.models import IdempotencyRecord

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.urls("testproject.urls")]

REPO_ROOT = Path(__file__).resolve().parent.parent
State = IdempotencyRecord.State
STRIPE = "/v1/webhooks/stripe"
GITHUB = "/v1/webhooks/github"


def stripe_event(event_id: str, **extra: Any) -> bytes:
    body = {"id": event_id, "object": "event", "type": "payment_intent.succeeded", **extra}
    return json.dumps(body).encode()


def deliver_to_stripe_endpoint(
    client: Client, payload: bytes, *, secret: str | None = None, at: float | None = None
) -> Any:
    """POST ``payload`` signed as Stripe signs it (``secret``: another, for a forgery)."""
    timestamp = int(time.time() if at is None else at)
    signature = stripe_signature(payload, secret or settings.STRIPE_WEBHOOK_SECRET, timestamp)
    return client.post(
        STRIPE,
        payload,
        content_type="application/json",
        HTTP_STRIPE_SIGNATURE=f"t={timestamp},v1={signature}",
    )


def runs(delivery: str) -> int:
    return WebhookEvent.objects.filter(delivery=delivery).count()


# -- Stripe ------------------------------------------------------------------------------


def test_a_stripe_event_delivered_twice_runs_once(client: Client) -> None:
    first = deliver_to_stripe_endpoint(client, stripe_event("evt_1"))
    again = deliver_to_stripe_endpoint(client, stripe_event("evt_1"))

    assert first.status_code == again.status_code == 200
    assert again["Idempotent-Replayed"] == "true"
    assert "Idempotency-Key" not in again
    assert runs("evt_1") == 1
    record = IdempotencyRecord.objects.get()
    assert (record.tenant, record.key, record.state) == ("stripe", "evt_1", State.COMPLETED)


def test_a_redelivery_whose_payload_changed_outside_the_fingerprint_replays(
    client: Client,
) -> None:
    deliver_to_stripe_endpoint(client, stripe_event("evt_1", pending_webhooks=2))
    again = deliver_to_stripe_endpoint(client, stripe_event("evt_1", pending_webhooks=1))

    assert again["Idempotent-Replayed"] == "true"
    assert runs("evt_1") == 1


def test_a_forged_stripe_delivery_with_the_genuine_id_stores_nothing(client: Client) -> None:
    forged = deliver_to_stripe_endpoint(client, stripe_event("evt_1"), secret="whsec_guess")

    assert forged.status_code == 401
    assert IdempotencyRecord.objects.count() == 0

    genuine = deliver_to_stripe_endpoint(client, stripe_event("evt_1"))

    assert genuine.status_code == 200
    assert "Idempotent-Replayed" not in genuine
    assert runs("evt_1") == 1


def test_a_stripe_body_altered_after_signing_is_refused(client: Client) -> None:
    timestamp = int(time.time())
    signature = stripe_signature(stripe_event("evt_1"), settings.STRIPE_WEBHOOK_SECRET, timestamp)
    altered = client.post(
        STRIPE,
        stripe_event("evt_1", amount=1),
        content_type="application/json",
        HTTP_STRIPE_SIGNATURE=f"t={timestamp},v1={signature}",
    )

    assert altered.status_code == 401
    assert IdempotencyRecord.objects.count() == 0


@pytest.mark.parametrize("header", ["", "t=abc,v1=00", "v1=00", "t=1,t=2,v1=00", "garbage", "t=1"])
def test_a_malformed_stripe_signature_is_refused(client: Client, header: str) -> None:
    response = client.post(
        STRIPE, stripe_event("evt_1"), content_type="application/json", HTTP_STRIPE_SIGNATURE=header
    )

    assert response.status_code == 401
    assert IdempotencyRecord.objects.count() == 0


def test_a_stale_stripe_signature_is_refused(client: Client) -> None:
    """A replayed capture of an old delivery: signed correctly, ten minutes ago."""
    response = deliver_to_stripe_endpoint(client, stripe_event("evt_1"), at=time.time() - 600)

    assert response.status_code == 401
    assert IdempotencyRecord.objects.count() == 0


def test_several_v1_signatures_one_of_them_right_are_accepted(client: Client) -> None:
    """While a secret is rolled, Stripe signs with the old and the new one."""
    payload = stripe_event("evt_1")
    timestamp = int(time.time())
    good = stripe_signature(payload, settings.STRIPE_WEBHOOK_SECRET, timestamp)
    response = client.post(
        STRIPE,
        payload,
        content_type="application/json",
        HTTP_STRIPE_SIGNATURE=f"t={timestamp},v1={'0' * 64},v1={good}",
    )

    assert response.status_code == 200


# -- GitHub ------------------------------------------------------------------------------


def deliver_to_github_endpoint(
    client: Client, delivery: str, payload: bytes, *, secret: str | None = None
) -> Any:
    signature = github_signature(payload, secret or settings.GITHUB_WEBHOOK_SECRET)
    return client.post(
        GITHUB,
        payload,
        content_type="application/json",
        HTTP_X_GITHUB_DELIVERY=delivery,
        HTTP_X_GITHUB_EVENT="push",
        HTTP_X_HUB_SIGNATURE_256=signature,
    )


def test_a_github_delivery_redelivered_runs_once(client: Client) -> None:
    delivery = str(uuid.uuid4())
    first = deliver_to_github_endpoint(client, delivery, b'{"action": "opened"}')
    again = deliver_to_github_endpoint(client, delivery, b'{"action": "opened"}')

    assert first.status_code == again.status_code == 200
    assert again["Idempotent-Replayed"] == "true"
    assert runs(delivery) == 1
    assert IdempotencyRecord.objects.get().tenant == "github"


def test_a_forged_github_delivery_with_the_genuine_id_stores_nothing(client: Client) -> None:
    delivery = str(uuid.uuid4())
    forged = deliver_to_github_endpoint(client, delivery, b"{}", secret="guess")

    assert forged.status_code == 401
    assert IdempotencyRecord.objects.count() == 0

    genuine = deliver_to_github_endpoint(client, delivery, b"{}")

    assert genuine.status_code == 200
    assert "Idempotent-Replayed" not in genuine
    assert runs(delivery) == 1


def test_an_unsigned_github_delivery_is_refused(client: Client) -> None:
    response = client.post(
        GITHUB, b"{}", content_type="application/json", HTTP_X_GITHUB_DELIVERY="d-1"
    )

    assert response.status_code == 401
    assert IdempotencyRecord.objects.count() == 0


def test_a_github_delivery_is_keyed_by_the_digest_of_its_signed_body(client: Client) -> None:
    payload = b'{"action": "opened"}'
    deliver_to_github_endpoint(client, str(uuid.uuid4()), payload)

    assert IdempotencyRecord.objects.get().key == hashlib.sha256(payload).hexdigest()


def test_a_signed_github_delivery_without_a_body_is_refused(client: Client) -> None:
    response = deliver_to_github_endpoint(client, str(uuid.uuid4()), b"")

    assert response.status_code == 400
    assert response.json()["code"] == "idempotency_key_missing"
    assert "request body" in response.json()["detail"]
    assert WebhookEvent.objects.count() == 0


def test_a_captured_github_body_sent_with_an_unsigned_query_string_gets_the_replay(
    client: Client,
) -> None:
    """The query string is not signed: it cannot make the same event another request."""
    payload = b'{"action": "opened"}'
    deliver_to_github_endpoint(client, str(uuid.uuid4()), payload)
    signature = github_signature(payload, settings.GITHUB_WEBHOOK_SECRET)
    again = client.post(
        GITHUB + "?attempt=2",
        payload,
        content_type="application/json",
        HTTP_X_GITHUB_DELIVERY=str(uuid.uuid4()),
        HTTP_X_HUB_SIGNATURE_256=signature,
    )

    assert again.status_code == 200
    assert again["Idempotent-Replayed"] == "true"
    assert WebhookEvent.objects.count() == 1


def test_a_captured_github_body_sent_again_under_new_delivery_ids_runs_the_handler_once(
    client: Client,
) -> None:
    """The delivery id is not signed: anyone holding one signed body can make up new ids."""
    payload = b'{"action": "opened", "number": 7}'
    first = deliver_to_github_endpoint(client, str(uuid.uuid4()), payload)
    replays = [deliver_to_github_endpoint(client, str(uuid.uuid4()), payload) for _ in range(3)]

    assert WebhookEvent.objects.count() == 1
    assert first.status_code == 200
    assert [replay.status_code for replay in replays] == [200, 200, 200]
    assert all(replay["Idempotent-Replayed"] == "true" for replay in replays)


def test_a_captured_github_body_sent_first_under_a_genuine_delivery_id_cannot_block_it(
    client: Client,
) -> None:
    """The attacker sends an old signed body under the id GitHub is about to redeliver."""
    upcoming = str(uuid.uuid4())
    captured = b'{"action": "closed", "number": 6}'
    genuine = b'{"action": "opened", "number": 7}'

    deliver_to_github_endpoint(client, upcoming, captured)
    redelivery = deliver_to_github_endpoint(client, upcoming, genuine)

    assert redelivery.status_code == 200, redelivery.content
    assert "Idempotent-Replayed" not in redelivery
    assert sorted(WebhookEvent.objects.values_list("kind", flat=True)) == [
        "push:closed",
        "push:opened",
    ]


# -- the pages show this very code ----------------------------------------------------------

_FENCE = re.compile(r'^```python title="(?P<path>[^"]+)"\n(?P<body>.*?)^```$', re.M | re.S)


@pytest.mark.parametrize(
    ("page", "path"),
    [
        ("webhooks-stripe.md", "payments/stripe_webhooks.py"),
        ("webhooks-github.md", "payments/github_webhooks.py"),
    ],
)
def test_the_how_to_page_shows_the_tested_code(page: str, path: str) -> None:
    text = (REPO_ROOT / "docs" / page).read_text()
    blocks = {match["path"]: match["body"] for match in _FENCE.finditer(text)}

    assert blocks[path] == (REPO_ROOT / "testproject" / path).read_text()
