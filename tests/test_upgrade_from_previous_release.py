"""An upgrade: records the previous release left behind are served right by this code.

The previous release (``PREVIOUS_RELEASE``, extracted with ``git archive``)
migrates the app's table into this run's test database and fills it, in a
subprocess, by running for real (tests/fill_with_previous_release.py):
records in every state, encrypted and plain, from every kind of view, with
provider keys and provider operation ids, and ``idempotent_task`` records.
Then this checkout migrates the same database and must:

- keep every column of every record as it was;
- replay each resolved record: same status, body bytes and stored headers;
- refuse other input under a used key (422), a key whose owner still
  holds its lease (409) and one whose outcome is UNCERTAIN (503);
- take over a dead owner's claim when the client retries (HTTP and task);
- purge only resolved records past retention;
- recover the rest: stale claims released, IN_PROGRESS and UNCERTAIN
  records settled by their reconciler, under the provider key and
  provider operation id the previous release stored.

``PREVIOUS_RELEASE`` is the commit of the last release tagged; move it to
each new release's commit when it is tagged, and adapt the fill script to
that release's layout if needed (docs/upgrading.md).
"""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from cryptography.fernet import Fernet
from django.conf import settings as django_settings
from django.core.management import call_command
from django.db import connection
from django.db.migrations.recorder import MigrationRecorder
from django.utils import timezone
from rest_framework.test import APIClient

from django_idempotency import recovery, tasks
from django_idempotency.models import IdempotencyRecord, IdempotencyStep
from django_idempotency.recovery import Completed, register_reconciler
from django_idempotency.tasks import TaskKeyReused, idempotent_task
from tests.previous_release import PREVIOUS_RELEASE, extract_release

pytestmark = pytest.mark.django_db(transaction=True)

FILL_SCRIPT = Path(__file__).resolve().parent / "fill_with_previous_release.py"
#: What the fill script imports of the previous release's tree.
RELEASE_PATHS = [
    "django_idempotency",
    "tests/__init__.py",
    "tests/settings.py",
    "tests/configurations",
    "tests/testapp",
    "tests/utils.py",
    "testproject/payments",
]
ENCRYPTION_KEY = Fernet.generate_key().decode()
State = IdempotencyRecord.State
#: Columns a migration must carry over unchanged.
KEPT = [
    "tenant",
    "operation",
    "key",
    "fingerprint",
    "state",
    "lease_owner",
    "lease_expires_at",
    "fencing_token",
    "provider_key",
    "provider_operation_id",
    "response_status",
    "response_headers",
    "response_body",
    "response_sealed",
    "created_at",
    "updated_at",
    "expires_at",
]


def extract_previous_release(into: Path) -> Path:
    """The previous release's tree with the fill script, or a skip (locally) / failure (CI)."""
    extract_release(PREVIOUS_RELEASE, RELEASE_PATHS, into)
    # At the root, beside the release's packages: it checks that it imports them.
    shutil.copy(FILL_SCRIPT, into)
    return into


def drop_the_apps_table() -> None:
    """Leave the database as one that never had the app: the old release creates its table."""
    with connection.schema_editor() as editor:
        # The steps first: their foreign key (ON DELETE CASCADE) refers to the records.
        editor.delete_model(IdempotencyStep)
        editor.delete_model(IdempotencyRecord)
    MigrationRecorder(connection).migration_qs.filter(app="django_idempotency").delete()


def fill_with_previous_release(release: Path) -> dict[str, Any]:
    database = {
        name: connection.settings_dict[name]
        for name in ("ENGINE", "NAME", "USER", "PASSWORD", "HOST", "PORT", "OPTIONS")
    }
    plan = {
        "database": database,
        "secret_key": django_settings.SECRET_KEY,
        "secret_key_fallbacks": list(django_settings.SECRET_KEY_FALLBACKS),
        "encryption_key": ENCRYPTION_KEY,
    }
    environment = {
        name: value
        for name, value in os.environ.items()
        if name not in ("DJANGO_SETTINGS_MODULE", "IDEMPOTENCY_TEST_CONFIGURATION")
    }
    environment["PYTHONPATH"] = str(release)
    done = subprocess.run(
        [sys.executable, str(release / FILL_SCRIPT.name), json.dumps(plan)],
        cwd=release,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"the previous release failed to fill the database:\n{done.stderr}"
    filled: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return filled


@pytest.fixture
def previous(tmp_path: Path, settings: Any) -> Iterator[dict[str, Any]]:
    """What the previous release wrote; the database then migrated by this code."""
    release = extract_previous_release(tmp_path)
    drop_the_apps_table()
    try:
        filled = fill_with_previous_release(release)
    finally:
        # This code's migrations, on whatever the old ones left (and so that
        # the table exists for the teardown's flush even if the fill failed).
        call_command("migrate", "django_idempotency", verbosity=0)
    settings.IDEMPOTENCY = {"ENCRYPTION_KEYS": [ENCRYPTION_KEY]}
    yield filled


@pytest.fixture
def reconciled(previous: dict[str, Any]) -> Iterator[list[tuple[str, str, str]]]:
    """A reconciler for the previous release's external-call view; what it was asked."""
    operation = record_of(previous, "uncertain")["operation"]
    asked: list[tuple[str, str, str]] = []

    @register_reconciler(operation)
    def settle(record: IdempotencyRecord) -> Completed:
        asked.append((record.key, record.provider_key, record.provider_operation_id))
        return Completed(status=201, body={"settled": record.key})

    yield asked
    recovery._reconcilers.pop(operation)


# -- helpers -----------------------------------------------------------------------------


def record_of(previous: dict[str, Any], name: str) -> dict[str, Any]:
    key = previous["responses"][name]["key"] if name in previous["responses"] else name
    rows: list[dict[str, Any]] = [row for row in previous["records"] if row["key"] == key]
    (row,) = rows
    return row


def now_row(key: str) -> dict[str, Any] | None:
    record = IdempotencyRecord.objects.filter(key=key).first()
    if record is None:
        return None
    row = {}
    for name in KEPT:
        value = getattr(record, name)
        if isinstance(value, bytes | memoryview):
            value = base64.b64encode(bytes(value)).decode()
        elif isinstance(value, datetime):
            value = value.isoformat()
        row[name] = value
    return row


def resend(client: APIClient, previous: dict[str, Any], name: str, **changes: Any) -> Any:
    sent = previous["responses"][name]
    body = {**sent["body"], **changes}
    return client.post(sent["url"], body, format="json", HTTP_IDEMPOTENCY_KEY=sent["key"])


def assert_replays(response: Any, original: dict[str, Any], stored_headers: list[Any]) -> None:
    replayed = (response.status_code, response.get("Idempotent-Replayed"))
    assert replayed == (original["status"], "true"), response.content[:500]
    assert response.content == base64.b64decode(original["content"])
    for header in ("Content-Type", "Location"):
        assert response.get(header) == original["headers"].get(header)
    for header, value in stored_headers:
        assert response[header] == value


def assert_refused(response: Any, status: int, code: str) -> None:
    assert (response.status_code, response.json()["code"]) == (status, code)


RESOLVED = [
    "completed",
    "completed_sealed",
    "failed",
    "failed_sealed",
    "completed_cbv",
    "completed_mixin",
    "completed_viewset",
    "completed_action",
    "completed_plain_view",
    "completed_selected_fields",
]
IN_FLIGHT = ["claimed_live", "in_progress_live"]


# -- the test ----------------------------------------------------------------------------


def test_records_of_the_previous_release_are_replayed_refused_recovered_and_purged(
    previous: dict[str, Any], reconciled: list[tuple[str, str, str]]
) -> None:
    client = APIClient()
    states = {row["key"]: row["state"] for row in previous["records"]}
    assert set(states.values()) == set(State.values)  # every state, as the old code wrote it
    assert any(row["response_sealed"] for row in previous["records"])

    # The migration kept every record as it was.
    for row in previous["records"]:
        assert now_row(row["key"]) == {name: row[name] for name in KEPT}

    for name in RESOLVED:
        row = record_of(previous, name)
        headers = [] if row["response_sealed"] else row["response_headers"]
        assert_replays(resend(client, previous, name), previous["responses"][name], headers)
        assert_refused(resend(client, previous, name, amount=999), 422, "idempotency_key_reused")

    for name in IN_FLIGHT:
        in_flight = resend(client, previous, name)
        assert_refused(in_flight, 409, "idempotency_request_in_progress")
        assert in_flight["Retry-After"]
    uncertain = resend(client, previous, "uncertain")
    assert_refused(uncertain, 503, "idempotency_outcome_uncertain")
    assert uncertain["Retry-After"]
    assert_refused(
        resend(client, previous, "claimed_live", amount=999), 422, "idempotency_key_reused"
    )

    taken_over_by_a_retry(client, previous)
    tasks_deduplicated(previous)
    purged = purge(previous)
    recovered(client, previous, reconciled)

    # Nothing else was touched: the records still in flight are as they were.
    for name in ("claimed_live", "in_progress_live"):
        assert now_row(record_of(previous, name)["key"]) == {
            field: record_of(previous, name)[field] for field in KEPT
        }
    assert not IdempotencyRecord.objects.filter(key__in=purged).exists()


def taken_over_by_a_retry(client: APIClient, previous: dict[str, Any]) -> None:
    """A dead owner's claim, retried with the same input: the view runs, once."""
    before = record_of(previous, "claimed_stale")
    retry = resend(client, previous, "claimed_stale")
    assert retry.status_code == 201 and "Idempotent-Replayed" not in retry
    record = IdempotencyRecord.objects.get(key=before["key"])
    assert (record.state, record.fencing_token) == (State.COMPLETED, before["fencing_token"] + 1)
    first = {
        "status": retry.status_code,
        "content": base64.b64encode(retry.content).decode(),
        "headers": dict(retry.items()),
    }
    assert_replays(resend(client, previous, "claimed_stale"), first, [])


def tasks_deduplicated(previous: dict[str, Any]) -> None:
    """The same task, as this code defines it: stored results returned, a dead claim run once."""
    ran: list[str] = []

    @idempotent_task(key="event_id", operation="upgrade ship order")
    def ship_order(event_id: str, amount: int) -> dict[str, Any]:
        ran.append(event_id)
        return {"shipped": event_id, "amount": amount}

    assert ship_order("evt-1", 5) == previous["tasks"]["task_completed"]
    assert ship_order("evt-2", 6) == previous["tasks"]["task_completed_sealed"]
    with pytest.raises(TaskKeyReused):
        ship_order("evt-1", 999)
    assert ran == []
    dead = record_of(previous, "evt-3")
    assert dead["state"] == State.CLAIMED
    assert ship_order("evt-3", 7) == {"shipped": "evt-3", "amount": 7}
    assert ship_order("evt-3", 7) == {"shipped": "evt-3", "amount": 7}
    assert ran == ["evt-3"]
    record = IdempotencyRecord.objects.get(key="evt-3")
    assert (record.state, record.fencing_token) == (State.COMPLETED, dead["fencing_token"] + 1)


def purge(previous: dict[str, Any]) -> set[str]:
    """The purge command deletes the resolved records past retention, and only those."""
    # The UNCERTAIN one too: it was written last, so it may expire last (a
    # loaded machine), and the purge must be seen passing over an expired one.
    expiring = [
        record_of(previous, name)
        for name in ("expiring_completed", "expiring_failed", "uncertain_expiring")
    ]
    last_expiry = max(datetime.fromisoformat(row["expires_at"]) for row in expiring)
    wait_until(lambda: timezone.now() > last_expiry)
    rows = {row["key"]: row for row in previous["records"]}
    uncertain_expiring = expiring.pop()
    before = set(IdempotencyRecord.objects.values_list("key", flat=True))
    started = timezone.now()

    call_command("idempotency_purge", "--pause-factor", "0", stdout=io.StringIO())

    finished = timezone.now()
    left = set(IdempotencyRecord.objects.values_list("key", flat=True))
    purged = before - left

    def past_retention(at: datetime) -> set[str]:
        return {
            key
            for key, row in rows.items()
            if row["state"] in (State.COMPLETED, State.FAILED)
            and datetime.fromisoformat(row["expires_at"]) <= at
        }

    # Exactly the resolved records past retention (one may pass it meanwhile).
    assert past_retention(started) <= purged <= past_retention(finished)
    assert {row["key"] for row in expiring} <= purged
    # Never an unresolved record, however long past its retention.
    assert uncertain_expiring["key"] in left
    return purged


def recovered(
    client: APIClient, previous: dict[str, Any], reconciled: list[tuple[str, str, str]]
) -> None:
    """The recovery task: stale claims released, the others settled by the reconciler."""
    result = tasks.recover_stale_records.apply().get()

    assert (result["released"], result["completed"]) == (1, 3)
    assert not IdempotencyRecord.objects.filter(
        key=record_of(previous, "claimed_stale_recovered")["key"]
    ).exists()
    settled = ["uncertain", "uncertain_expiring", "in_progress_stale"]
    asked_about = {
        (row["key"], row["provider_key"], row["provider_operation_id"])
        for row in (record_of(previous, name) for name in settled)
    }
    assert set(reconciled) == asked_about
    assert all(provider_key for _, provider_key, _ in reconciled)
    assert {operation_id for _, _, operation_id in reconciled} == {"op-u", "", "op-ip"}
    for name in settled:
        replay = resend(client, previous, name)
        replayed = (replay.status_code, replay.get("Idempotent-Replayed"))
        assert replayed == (201, "true"), replay.content[:500]
        assert replay.json() == {"settled": previous["responses"][name]["key"]}
    # A stale claim released by recovery runs again when its client retries.
    rerun = resend(client, previous, "claimed_stale_recovered")
    assert rerun.status_code == 201 and "Idempotent-Replayed" not in rerun


def wait_until(condition: Callable[[], bool], *, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "waited too long"
        time.sleep(0.1)
