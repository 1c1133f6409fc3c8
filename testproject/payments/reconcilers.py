"""Settling payments whose request died mid-flight, from the provider's ledger.

``recover_stale_records`` (Celery) or ``manage.py idempotency_recover``
(cron) hands every stuck ``POST v1/payments`` record to
``settle_payment``. The record knows the provider key the view charged
with; the provider's charge carries, as metadata, what the view needs to
build the Payment (owner, order, amount, currency). So:

- no charge for the key: the provider was never charged, ``Release()``,
  and the client's retry runs the view again;
- a charge: the Payment is created if the dead request had not committed
  it (``get_or_create`` on owner and order), and the record is completed
  with the very answer the view gives, a 201 with the payment and its
  ``Location``;
- the order was paid by another charge meanwhile: the record fails with
  the view's own 409 ``order_already_paid`` (a real integration would
  refund this charge).

The reconciler runs inside the transaction that stores its outcome, so the
Payment and the COMPLETED record commit together.

``settle_two_step_payment`` settles ``POST v1/payments/two-step``
(``payments/two_step.py``: authorize, then capture) from the record's
steps, each looked up at the provider by its own provider key:

- no authorization: nothing happened, ``Release()``;
- an authorization, no capture: ``RetryFrom("capture")``, with the
  authorization's id if the view died before recording it; the client's
  retry skips the authorization and captures (one capture, under the
  capture step's key);
- a capture: the Payment is created if need be and the record completed
  with the view's 201, carrying the capture's id
  (``provider_operation_id``) for the admin's search.
"""

from __future__ import annotations

from django.contrib.auth import get_user_model

from django_idempotency.models import IdempotencyRecord
from django_idempotency.recovery import (
    Completed,
    Failed,
    ReconcilerOutcome,
    Release,
    RetryFrom,
    register_reconciler,
)
from payments import provider_client
from payments.models import Payment
from payments.rendering import order_already_paid_body, payment_answer

OPERATION = "POST v1/payments"
TWO_STEP_OPERATION = "POST v1/payments/two-step"


class ReconciliationError(Exception):
    """The charge does not match the record: an operator has to look.

    Raised, the recovery run logs it and asks again later; the record
    stays UNCERTAIN meanwhile.
    """


@register_reconciler(OPERATION)
def settle_payment(record: IdempotencyRecord) -> ReconcilerOutcome:
    if not record.provider_key:
        # begin_external() never committed: no call was made with a key.
        return Release()
    charge = provider_client.find_charge(record.provider_key)  # unreachable: raises, retried
    if charge is None:
        return Release()
    metadata = charge.metadata
    try:
        owner_id = int(metadata["owner_id"])
        order_id = str(metadata["order_id"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ReconciliationError(f"charge {charge.id} lacks the order metadata") from exc
    if record.tenant != f"user:{owner_id}":
        raise ReconciliationError(
            f"charge {charge.id} belongs to user {owner_id}, the record to {record.tenant!r}"
        )
    owner = get_user_model().objects.get(pk=owner_id)
    payment, _ = Payment.objects.get_or_create(
        owner=owner,
        order_id=order_id,
        defaults={
            "amount": charge.amount,
            "currency": charge.currency,
            "provider_charge_id": charge.id,
        },
    )
    if payment.provider_charge_id != charge.id:
        return Failed(
            status=409,
            body=order_already_paid_body(order_id),
            headers={"Content-Type": "application/json"},
        )
    body, location = payment_answer(payment)
    return Completed(
        status=201,
        body=body,
        headers={"Content-Type": "application/json", "Location": location},
    )


def _owner_of(record: IdempotencyRecord, charge: provider_client.Charge) -> tuple[int, str]:
    metadata = charge.metadata
    try:
        owner_id = int(metadata["owner_id"])
        order_id = str(metadata["order_id"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ReconciliationError(f"{charge.id} lacks the order metadata") from exc
    if record.tenant != f"user:{owner_id}":
        raise ReconciliationError(
            f"{charge.id} belongs to user {owner_id}, the record to {record.tenant!r}"
        )
    return owner_id, order_id


@register_reconciler(TWO_STEP_OPERATION)
def settle_two_step_payment(record: IdempotencyRecord) -> ReconcilerOutcome:
    steps = {step.name: step for step in record.steps.all()}
    authorize = steps.get("authorize")
    authorization = provider_client.find_charge(authorize.provider_key) if authorize else None
    if authorization is None:
        # Never authorized (the provider has nothing under the step's key):
        # the retry runs the whole payment.
        return Release()
    _owner_of(record, authorization)
    capture_step = steps.get("capture")
    capture = provider_client.find_charge(capture_step.provider_key) if capture_step else None
    if capture is None:
        # Authorized, never captured: the client's retry captures. The
        # authorization is kept, with its id, so the retry never sends it
        # again (the provider may have forgotten its key by then).
        assert authorize is not None
        found = {} if authorize.provider_operation_id else {"authorize": authorization.id}
        return RetryFrom("capture", provider_operation_ids=found)
    owner_id, order_id = _owner_of(record, capture)
    payment, _ = Payment.objects.get_or_create(
        owner=get_user_model().objects.get(pk=owner_id),
        order_id=order_id,
        defaults={
            "amount": capture.amount,
            "currency": capture.currency,
            "provider_charge_id": capture.id,
        },
    )
    if payment.provider_charge_id != capture.id:
        return Failed(
            status=409,
            body=order_already_paid_body(order_id),
            headers={"Content-Type": "application/json"},
            provider_operation_id=capture.id,
        )
    body, location = payment_answer(payment)
    return Completed(
        status=201,
        body=body,
        headers={"Content-Type": "application/json", "Location": location},
        provider_operation_id=capture.id,
    )
