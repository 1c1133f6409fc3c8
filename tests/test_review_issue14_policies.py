"""Review of issue 14: outcome policies on the single-transaction path.

``@idempotent(single_transaction=True, outcome=by_status({504: Verdict.UNCERTAIN}))``:
the claim rolls back with the view, so the record is claimed afresh and
must then be left UNCERTAIN for a reconciler. The afresh claim is a new
row (a new id); the request's ``IdempotencyContext`` still holds the
rolled-back claim, so ``leave_uncertain()`` fences on a row that never
committed, raises StaleOwner (logged), and the record stays CLAIMED under
a live lease: after it, recovery releases it and the retry runs the view
again, the uncertain outcome forgotten.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from rest_framework.test import APIClient

from django_idempotency._store.database_time import DatabaseLater
from django_idempotency.models import IdempotencyRecord
from django_idempotency.recovery import recover_stale_records
from tests.testapp.models import Charge
from tests.utils import post

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres]
State = IdempotencyRecord.State


def test_single_transaction_uncertain_verdict_survives_recovery(api: APIClient) -> None:
    first = post(api, "/policy/single", {"amount": 5, "status": 504}, "k-1")
    assert first.status_code == 504

    record = IdempotencyRecord.objects.get()
    assert record.state == State.UNCERTAIN, (record.state, record.lease_owner)
    assert record.lease_owner == ""

    # Whatever the lease, recovery must never release an UNCERTAIN outcome.
    IdempotencyRecord.objects.update(lease_expires_at=DatabaseLater(-timedelta(seconds=1)))
    recover_stale_records()
    retry = post(api, "/policy/single", {"amount": 5, "status": 504}, "k-1")

    assert retry.status_code == 409, retry.content
    assert Charge.objects.count() == 0
