"""Fingerprints and provider keys at rest: keyed, versioned, and stable across rotation."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
from django.core.checks import Tags, run_checks
from rest_framework.test import APIClient

from django_idempotency import recovery, testing
from django_idempotency.fingerprint import canonical, fingerprint
from django_idempotency.models import IdempotencyRecord
from django_idempotency.recovery import Completed, register_reconciler
from django_idempotency.tasks import TaskKeyReused
from tests.utils import post

pytestmark = pytest.mark.django_db(transaction=True)
URL = "/api-view/charges"
EXTERNAL = "/api-view/external"
OLD_SECRET = "django-insecure-an-old-secret-key-of-this-project-0123456789"
NEW_SECRET = "django-insecure-the-new-secret-key-of-this-project-9876543210"


def bare_sha256(value: Any) -> str:
    """An unkeyed digest of the same canonical form: what an attacker can compute."""
    encoded = canonical(value)
    if not isinstance(encoded, bytes):  # canonical bytes produced in chunks
        encoded = b"".join(c if isinstance(c, bytes) else c.encode() for c in encoded)
    return hashlib.sha256(encoded).hexdigest()


def charge_input(amount: int) -> dict[str, Any]:
    """What the fingerprint of a POST to URL with {"amount": amount} covers."""
    return {"body": {"amount": amount}, "query": {}, "url": {"args": [], "kwargs": {}}}


def rotate_secret(settings: Any) -> None:
    settings.SECRET_KEY = NEW_SECRET
    settings.SECRET_KEY_FALLBACKS = [OLD_SECRET]


def test_a_stored_fingerprint_cannot_be_reversed_by_trying_amounts(api: APIClient) -> None:
    post(api, URL, {"amount": 1234}, "k")
    stored = IdempotencyRecord.objects.get().fingerprint

    tried = {bare_sha256(charge_input(amount)) for amount in range(5000)}

    assert bare_sha256(charge_input(1234)) in tried
    assert stored not in tried and stored.split(":", 1)[1] not in tried


def test_a_provider_key_cannot_be_reversed_to_the_tenant_and_key(api: APIClient) -> None:
    provider_key = post(api, EXTERNAL, {"amount": 1}, "k").json()["provider_key"]
    record = IdempotencyRecord.objects.get()

    material = json.dumps([record.tenant, record.operation, record.key]).encode("ascii")
    assert provider_key != hashlib.sha256(material).hexdigest()
    assert record.provider_key == provider_key


def test_each_stored_digest_carries_the_version_of_its_secret(
    api: APIClient, settings: Any
) -> None:
    settings.IDEMPOTENCY = {"DIGEST_KEYS": [("2026b", "n" * 40), ("2026a", "o" * 40)]}
    provider_key = post(api, EXTERNAL, {"amount": 1}, "k").json()["provider_key"]
    record = IdempotencyRecord.objects.get()

    assert record.fingerprint.startswith("2026b:") and len(record.fingerprint) == 70
    assert provider_key.startswith("2026b:") and len(provider_key) <= 64


def test_the_default_secret_comes_from_secret_key(settings: Any) -> None:
    settings.SECRET_KEY = OLD_SECRET
    under_old = fingerprint({"amount": 1})
    settings.SECRET_KEY = NEW_SECRET
    under_new = fingerprint({"amount": 1})

    assert under_old.stored != under_new.stored
    assert not under_new.matches(under_old.stored)
    settings.SECRET_KEY_FALLBACKS = [OLD_SECRET]
    assert fingerprint({"amount": 1}).matches(under_old.stored)


def test_a_retry_after_the_secret_rotated_replays(api: APIClient, settings: Any) -> None:
    settings.SECRET_KEY = OLD_SECRET
    first = post(api, URL, {"amount": 7}, "k")
    rotate_secret(settings)

    retry = post(api, URL, {"amount": 7}, "k")
    other = post(api, URL, {"amount": 8}, "k")

    assert retry.status_code == 201 and retry["Idempotent-Replayed"] == "true"
    assert retry.content == first.content
    assert other.status_code == 422


def test_a_retry_after_a_digest_key_rotated_replays(api: APIClient, settings: Any) -> None:
    settings.IDEMPOTENCY = {"DIGEST_KEYS": [("a", "o" * 40)]}
    first = post(api, URL, {"amount": 7}, "k")
    settings.IDEMPOTENCY = {"DIGEST_KEYS": [("b", "n" * 40), ("a", "o" * 40)]}

    assert post(api, URL, {"amount": 7}, "k").content == first.content
    assert post(api, URL, {"amount": 8}, "k").status_code == 422
    # Once the old secret is gone, its records no longer match (after retention).
    settings.IDEMPOTENCY = {"DIGEST_KEYS": [("b", "n" * 40)]}
    assert post(api, URL, {"amount": 7}, "k").status_code == 422


def test_a_fingerprint_without_a_version_matches_no_request(api: APIClient) -> None:
    # Every stored fingerprint names its secret; an unkeyed SHA-256 of the
    # same input is not accepted in its place.
    post(api, URL, {"amount": 9}, "k")
    IdempotencyRecord.objects.update(fingerprint=bare_sha256(charge_input(9)))

    retry = post(api, URL, {"amount": 9}, "k")

    assert retry.status_code == 422 and retry.json()["code"] == "idempotency_key_reused"


def test_an_uncertain_record_from_before_rotation_is_reconciled_with_its_provider_key(
    api: APIClient, settings: Any
) -> None:
    settings.SECRET_KEY = OLD_SECRET
    with pytest.raises(Exception, match="connection dropped"):
        post(api, EXTERNAL, {"amount": 1, "then": "raise"}, "k")
    record = IdempotencyRecord.objects.get()
    assert record.state == IdempotencyRecord.State.UNCERTAIN and record.provider_key
    rotate_secret(settings)
    asked: list[str] = []

    @register_reconciler("POST api-view/external")
    def settle(stuck: IdempotencyRecord) -> Completed:
        asked.append(stuck.provider_key)
        return Completed(status=201, body={"settled": True})

    try:
        testing.expire_leases()
        report = recovery.recover_stale_records()
    finally:
        recovery._reconcilers.pop("POST api-view/external")

    assert report.completed == 1 and asked == [record.provider_key]


def test_a_claim_taken_over_keeps_the_records_provider_key(api: APIClient) -> None:
    post(api, EXTERNAL, {"amount": 1}, "k")
    # As an older version (or an older secret) left it: CLAIMED, lease run
    # out, with a provider key that today's secret would not derive.
    IdempotencyRecord.objects.update(
        state=IdempotencyRecord.State.CLAIMED,
        provider_key="an-older-provider-key",
        response_status=None,
        response_body=None,
        lease_owner="gone:1:1",
    )
    testing.expire_leases()

    retry = post(api, EXTERNAL, {"amount": 1}, "k")

    assert retry.status_code == 201 and "Idempotent-Replayed" not in retry
    assert retry.json()["provider_key"] == "an-older-provider-key"
    assert IdempotencyRecord.objects.get().provider_key == "an-older-provider-key"


def test_a_task_record_from_before_rotation_returns_its_stored_result(settings: Any) -> None:
    from tests.test_idempotent_task import charge

    settings.SECRET_KEY = OLD_SECRET
    first = charge("evt-digest-rotation", 5)
    rotate_secret(settings)

    assert charge("evt-digest-rotation", 5) == first
    # An unkeyed SHA-256 of the same arguments is not the task's fingerprint.
    record = IdempotencyRecord.objects.get(key="evt-digest-rotation")
    IdempotencyRecord.objects.filter(pk=record.pk).update(
        fingerprint=bare_sha256({"event_id": "evt-digest-rotation", "amount": 5, "fail": False})
    )
    with pytest.raises(TaskKeyReused):
        charge("evt-digest-rotation", 5)


def test_fingerprints_fed_in_chunks_equal_one_shot_fingerprints() -> None:
    from django_idempotency._store.digests import FingerprintHasher

    encoded = canonical({"a": [1, 2, "three"]})
    if not isinstance(encoded, bytes):
        encoded = b"".join(c if isinstance(c, bytes) else c.encode() for c in encoded)
    hasher = FingerprintHasher()
    for index in range(0, len(encoded), 3):
        hasher.update(encoded[index : index + 3].decode("ascii"))

    assert hasher.finish() == fingerprint({"a": [1, 2, "three"]})


@pytest.mark.parametrize(
    "value",
    [
        "not a list",
        [("a", "short")],
        [("bad:version", "s" * 40)],
        [("", "s" * 40)],
        [("a", "s" * 40), ("a", "t" * 40)],
        [("a", "s" * 40, "extra")],
        [],
    ],
)
def test_a_malformed_digest_keys_setting_fails_its_check(settings: Any, value: Any) -> None:
    settings.IDEMPOTENCY = {"DIGEST_KEYS": value}

    errors = [m for m in run_checks(tags=[Tags.compatibility]) if m.id == "django_idempotency.E021"]

    assert len(errors) == 1 and errors[0].hint


def test_a_well_formed_digest_keys_setting_passes_its_check(settings: Any) -> None:
    settings.IDEMPOTENCY = {"DIGEST_KEYS": [("2026b", "n" * 40), ("2026a", b"o" * 32)]}

    assert not [
        m for m in run_checks(tags=[Tags.compatibility]) if m.id == "django_idempotency.E021"
    ]


def test_the_digest_salt_is_part_of_the_stored_format_and_never_changes() -> None:
    # Every stored fingerprint and provider key is keyed with it: a new salt
    # (a module moved, say) would make every stored record unrecognisable.
    from django_idempotency._store import digests

    assert digests._SALT == "django_idempotency.digests"
