"""Webhooks with real processes: five deliveries at once, a redelivery an hour later, one run.

gunicorn (4 worker processes) serves the demo project (``testproject/``) on a
fresh PostgreSQL database; its webhook endpoints are the code the how-to
pages show (``payments/stripe_webhooks.py``, ``payments/github_webhooks.py``).
Each delivery is signed as the sender signs it. A handler run is a row of
``payments_webhookevent``, counted in the database.

"An hour later" is the record's clock moved back by an hour (``created_at``,
``updated_at`` and ``expires_at``, with an UPDATE on the live database):
the redelivery then meets the record as it would an hour after the first
delivery, still within the view's retention. Stripe signs each attempt
anew, so the redelivery carries a fresh timestamp and signature.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
import uuid
from collections.abc import Iterator

import pytest

from tests.live.server import (
    PAYMENTS_PROJECT,
    Call,
    Lazy,
    LiveServer,
    Result,
    fire_together,
    live_server,
)
from tests.live.services import require_postgres

pytestmark = [pytest.mark.postgres, pytest.mark.live, pytest.mark.guarantees]

STRIPE_SECRET = "whsec_live_test_secret"
GITHUB_SECRET = "github-live-test-secret"
DELIVERIES = 5


@pytest.fixture(scope="module")
def lazy_server() -> Iterator[Lazy[LiveServer]]:
    env = {"STRIPE_WEBHOOK_SECRET": STRIPE_SECRET, "GITHUB_WEBHOOK_SECRET": GITHUB_SECRET}
    lazy = Lazy(
        lambda: live_server(require_postgres(), project=PAYMENTS_PROJECT, extra_env=env),
        require_postgres,
    )
    yield lazy
    lazy.close()


def stripe_call(server: LiveServer, payload: bytes, secret: str = STRIPE_SECRET) -> Call:
    timestamp = str(int(time.time()))
    signature = hmac.new(
        secret.encode(), timestamp.encode() + b"." + payload, hashlib.sha256
    ).hexdigest()
    headers = {
        "Content-Type": "application/json",
        "Stripe-Signature": f"t={timestamp},v1={signature}",
    }
    return Call(server.url + "/v1/webhooks/stripe", None, headers, data=payload)


def github_call(server: LiveServer, delivery: str, payload: bytes) -> Call:
    signature = "sha256=" + hmac.new(GITHUB_SECRET.encode(), payload, hashlib.sha256).hexdigest()
    headers = {
        "Content-Type": "application/json",
        "X-GitHub-Delivery": delivery,
        "X-GitHub-Event": "push",
        "X-Hub-Signature-256": signature,
    }
    return Call(server.url + "/v1/webhooks/github", None, headers, data=payload)


def handler_runs(server: LiveServer, delivery: str) -> int:
    rows = server.database.query(
        "SELECT count(*) FROM payments_webhookevent WHERE delivery = %s", [delivery]
    )
    return int(rows[0][0])


def an_hour_passes(server: LiveServer, key: str) -> None:
    moved = server.database.query(
        "UPDATE django_idempotency_record SET created_at = created_at - interval '1 hour', "
        "updated_at = updated_at - interval '1 hour', expires_at = expires_at - interval '1 hour' "
        'WHERE "key" = %s RETURNING expires_at > now()',
        [key],
    )
    assert moved == [(True,)], f"one record, still within its retention: {moved}"


def explain(server: LiveServer, results: list[Result], key: str) -> str:
    lines = [result.describe() for result in results]
    lines.append(f"records: {server.database.records(key)}")
    lines.append(server.diagnostics())
    return "\n".join(lines)


def assert_one_run_among(results: list[Result], server: LiveServer, key: str) -> None:
    first = [r for r in results if r.status == 200 and not r.replayed]
    assert len(first) == 1, explain(server, results, key)
    # The others: the replay of that 200, or 409 while it ran (the sender
    # retries those later, and they get the replay).
    for result in results:
        assert result.status in (200, 409), explain(server, results, key)
        if result.status == 200:
            assert result.body == first[0].body, explain(server, results, key)


def test_a_stripe_event_delivered_five_times_at_once_then_an_hour_later_runs_once(
    lazy_server: Lazy[LiveServer],
) -> None:
    server = lazy_server.get()
    event_id = f"evt_{uuid.uuid4().hex}"
    payload = json.dumps(
        {"id": event_id, "object": "event", "type": "payment_intent.succeeded"}
    ).encode()

    storm = fire_together([stripe_call(server, payload)] * DELIVERIES)

    assert_one_run_among(storm, server, event_id)
    assert handler_runs(server, event_id) == 1, explain(server, storm, event_id)

    an_hour_passes(server, event_id)
    later = fire_together([stripe_call(server, payload)])[0]

    assert later.status == 200 and later.replayed, explain(server, [later], event_id)
    assert handler_runs(server, event_id) == 1, explain(server, [later], event_id)
    [record] = server.database.records(event_id)
    assert (record["tenant"], record["state"]) == ("stripe", "COMPLETED")


def test_a_forged_stripe_delivery_racing_the_genuine_ones_changes_nothing(
    lazy_server: Lazy[LiveServer],
) -> None:
    server = lazy_server.get()
    event_id = f"evt_{uuid.uuid4().hex}"
    payload = json.dumps({"id": event_id, "object": "event", "type": "charge.refunded"}).encode()
    forged = stripe_call(server, payload, secret="whsec_a_guess")

    results = fire_together([forged, *[stripe_call(server, payload)] * DELIVERIES])

    assert results[0].status == 401, explain(server, results, event_id)
    assert_one_run_among(results[1:], server, event_id)
    assert handler_runs(server, event_id) == 1


def test_a_github_delivery_sent_five_times_at_once_then_an_hour_later_runs_once(
    lazy_server: Lazy[LiveServer],
) -> None:
    server = lazy_server.get()
    delivery = str(uuid.uuid4())
    # Each run its own event: the key is the digest of the signed body.
    payload = json.dumps({"action": "opened", "number": 7, "run": delivery}).encode()
    key = hashlib.sha256(payload).hexdigest()

    storm = fire_together([github_call(server, delivery, payload)] * DELIVERIES)

    assert_one_run_among(storm, server, key)
    assert handler_runs(server, delivery) == 1

    an_hour_passes(server, key)
    later = fire_together([github_call(server, delivery, payload)])[0]

    assert later.status == 200 and later.replayed, explain(server, [later], key)
    assert handler_runs(server, delivery) == 1
