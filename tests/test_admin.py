"""The admin with Django's test client: a log, with guarded resolving actions."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission
from django.test import Client, override_settings
from django.utils import timezone
from rest_framework.test import APIClient

from django_idempotency import recovery
from django_idempotency.models import IdempotencyRecord
from tests.factories import RecordFactory, UserFactory
from tests.utils import post, raw_body

pytestmark = pytest.mark.django_db(transaction=True)
State = IdempotencyRecord.State
CHANGELIST = "/admin/django_idempotency/idempotencyrecord/"
ACTIONS = ["reconcile_now", "mark_failed", "mark_completed", "release", "extend_retention"]
PERMISSION_OF = {
    "reconcile_now": "reconcile",
    "mark_failed": "mark_failed",
    "mark_completed": "mark_completed",
    "release": "release",
    "extend_retention": "extend",
}


def staff(*codenames: str) -> Client:
    user = UserFactory.create(is_staff=True)
    user.user_permissions.add(
        *Permission.objects.filter(
            content_type__app_label="django_idempotency",
            codename__in=["view_idempotencyrecord", *(f"{c}_idempotencyrecord" for c in codenames)],
        )
    )
    client = Client()
    client.force_login(user)
    return client


def stuck_record(**fields: Any) -> IdempotencyRecord:
    defaults: dict[str, Any] = {
        "state": State.UNCERTAIN,
        "response_status": None,
        "response_body": None,
        "response_headers": [],
        "lease_expires_at": timezone.now() - timedelta(minutes=1),
        "provider_key": "pk_1",
    }
    return RecordFactory.create(**{**defaults, **fields})


def run(client: Client, action: str, record: IdempotencyRecord, **data: Any) -> Any:
    if "apply" in data:  # the action page's form posts back what it showed
        shown = {f"token-{record.pk}": record.fencing_token, f"state-{record.pk}": record.state}
        data = {**shown, **data}
    return client.post(
        CHANGELIST, {"action": action, "_selected_action": [record.pk], **data}, follow=True
    )


def test_changelist_shows_counts_per_state_and_stuck() -> None:
    RecordFactory.create_batch(3)
    stuck_record()
    RecordFactory.create(
        state=State.CLAIMED, lease_expires_at=timezone.now() + timedelta(minutes=1)
    )

    page = staff().get(CHANGELIST)

    assert page.status_code == 200
    text = page.content.decode()
    assert 'data-state="COMPLETED"' in text
    counts = {entry["value"]: entry["count"] for entry in page.context["state_counts"]}
    assert counts == {
        "CLAIMED": "1",
        "IN_PROGRESS": "0",
        "UNCERTAIN": "1",
        "COMPLETED": "3",
        "FAILED": "0",
        "stuck": "1",
    }


def test_on_a_large_postgresql_table_the_resolved_counts_are_the_planners_estimate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # No index holds COMPLETED or FAILED on PostgreSQL (the recovery and
    # expiry indexes are partial): an exact count would read the table.
    from django.db import connection

    from django_idempotency import census

    monkeypatch.setattr(census, "_SCANNED_UP_TO", 5)
    RecordFactory.create_batch(8)
    stuck_record()
    if connection.vendor == "postgresql":  # the planner's figures, as autovacuum keeps them
        with connection.cursor() as cursor:
            cursor.execute(f"ANALYZE {IdempotencyRecord._meta.db_table}")

    page = staff().get(CHANGELIST)

    counts = {entry["value"]: entry["count"] for entry in page.context["state_counts"]}
    assert (counts["UNCERTAIN"], counts["stuck"]) == ("1", "1")  # always counted
    if connection.vendor == "postgresql":
        assert counts["COMPLETED"].startswith("~") and counts["FAILED"].startswith("~")
    else:
        assert (counts["COMPLETED"], counts["FAILED"]) == ("8", "0")


@pytest.fixture
def provider_down() -> Iterator[str]:
    """An operation whose reconciler cannot reach its provider: it asks again in 5 minutes."""
    operation = "POST admin-test-outage"

    @recovery.register_reconciler(operation)
    def ask_again_later(record: IdempotencyRecord) -> recovery.ReconcilerOutcome:
        return recovery.Retry(after=timedelta(minutes=5))

    yield operation
    del recovery._reconcilers[operation]


def test_records_recovery_postponed_in_an_outage_are_counted_and_listed_as_stuck(
    provider_down: str,
) -> None:
    """The first view an operator opens shows what waits, not only expired leases."""
    postponed = stuck_record(state=State.IN_PROGRESS, operation=provider_down)
    at_work = stuck_record(
        state=State.IN_PROGRESS,
        lease_owner="web-1:1",
        lease_expires_at=timezone.now() + timedelta(minutes=1),
    )
    assert recovery.recover_stale_records().retried == 1
    postponed.refresh_from_db()
    assert postponed.state == State.UNCERTAIN and postponed.lease_expires_at is not None
    assert postponed.lease_expires_at > timezone.now()  # recovery asks again in 5 minutes
    client = staff()

    page = client.get(CHANGELIST)

    counts = {entry["value"]: entry["count"] for entry in page.context["state_counts"]}
    assert counts["stuck"] == "1"
    assert page.context["state_counts"][0]["value"] == "stuck"  # where to start: first
    stuck_list = client.get(CHANGELIST + "?state=stuck")
    assert [record.pk for record in stuck_list.context["cl"].result_list] == [postponed.pk]
    row = stuck_list.content.decode().split(f"{postponed.pk}/change/")[1].split("</tr>")[0]
    assert '<td class="field-lease_status">postponed</td>' in row
    assert at_work.pk not in {r.pk for r in stuck_list.context["cl"].result_list}


def test_filters_and_exact_search() -> None:
    later = timezone.now() + timedelta(days=2)
    stuck = stuck_record(key="stuck-one", provider_operation_id="ch_42", expires_at=later)
    held = RecordFactory.create(
        state=State.CLAIMED, lease_expires_at=timezone.now() + timedelta(hours=1), expires_at=later
    )
    soon = RecordFactory.create(expires_at=timezone.now() + timedelta(minutes=10))
    client = staff()

    def listed(query: str) -> set[int]:
        return {record.pk for record in client.get(CHANGELIST + query).context["cl"].result_list}

    assert listed("?state=stuck") == {stuck.pk}
    assert listed("?state=CLAIMED") == {held.pk}
    assert listed("?expires=hour") == {soon.pk}
    assert listed("?q=ch_42") == {stuck.pk}
    assert listed("?q=stuck-one") == {stuck.pk}
    assert listed("?q=stuck") == set()  # exact, not "contains"


def test_the_retention_filters_and_dates_list_resolved_records_only() -> None:
    # Only a resolved record is replayed until expires_at and purged past
    # it; the filters say so in their query, which lets PostgreSQL walk the
    # partial expiry index (resolved states only).
    now = timezone.now()
    soon = RecordFactory.create(expires_at=now + timedelta(minutes=10))
    past = RecordFactory.create(state=State.FAILED, expires_at=now - timedelta(minutes=10))
    RecordFactory.create(
        state=State.CLAIMED, lease_expires_at=now + timedelta(minutes=1), expires_at=soon.expires_at
    )
    RecordFactory.create(
        state=State.IN_PROGRESS,
        lease_expires_at=now - timedelta(hours=1),
        expires_at=past.expires_at,
    )
    RecordFactory.create(state=State.UNCERTAIN, expires_at=now + timedelta(days=800))
    client = staff()

    def listed(query: str) -> set[int]:
        return {record.pk for record in client.get(CHANGELIST + query).context["cl"].result_list}

    assert listed("?expires=hour") == {soon.pk}
    assert listed("?expires=day") == {soon.pk}
    assert listed("?expires=expired") == {past.pk}
    day = timezone.localtime(soon.expires_at)
    dated = f"?expires_at__year={day.year}&expires_at__month={day.month}&expires_at__day={day.day}"
    assert soon.pk in listed(dated) and len(listed(dated) - {soon.pk, past.pk}) == 0
    # The hierarchy's years reach no further than the resolved records' expiries.
    far = (now + timedelta(days=800)).year
    assert f"expires_at__year={far}" not in client.get(CHANGELIST).content.decode()


def test_change_page_shows_the_stored_response_and_timeline() -> None:
    record = RecordFactory.create(
        response_body=b'{"id":7,"amount":100}',
        response_headers=[["Content-Type", "application/json"], ["Location", "/v1/payments/7"]],
        provider_operation_id="ch_7",
    )
    text = staff().get(f"{CHANGELIST}{record.pk}/change/").content.decode()

    assert "&quot;amount&quot;: 100" in text  # pretty-printed JSON
    assert "/v1/payments/7" in text
    assert record.fingerprint in text
    assert "ch_7" in text
    for label in ("created", "lease owner", "lease expires", "updated", "expires"):
        assert label in text


@pytest.mark.parametrize(
    ("body", "shown"),
    [
        # A plain view's JsonResponse writes a client's "\ud800" escaped: it
        # parses into a lone surrogate, which the page could not encode.
        (b'{"note": "\\ud800"}', "\\ud800"),
        # Deeper than json parses on every supported Python: shown as stored.
        (b"[" * 100_000 + b"]" * 100_000, "[[[["),
    ],
    ids=["lone-surrogate", "deep"],
)
def test_the_change_page_shows_a_stored_body_a_client_shaped(body: bytes, shown: str) -> None:
    record = RecordFactory.create(
        response_body=body, response_headers=[["Content-Type", "application/json"]]
    )

    page = staff().get(f"{CHANGELIST}{record.pk}/change/")

    assert page.status_code == 200
    assert shown in page.content.decode()


def test_nothing_can_be_added_edited_or_deleted() -> None:
    record = RecordFactory.create()
    client = staff(*PERMISSION_OF.values())
    client.force_login(UserFactory.create(is_staff=True, is_superuser=True))

    assert client.get(CHANGELIST + "add/").status_code == 403
    assert client.post(f"{CHANGELIST}{record.pk}/change/", {"state": "FAILED"}).status_code == 403
    assert client.post(f"{CHANGELIST}{record.pk}/delete/", {"post": "yes"}).status_code == 403
    record.refresh_from_db()
    assert record.state == State.COMPLETED


@pytest.mark.parametrize("action", ACTIONS)
def test_each_action_needs_its_own_permission(action: str) -> None:
    record = stuck_record(state=State.CLAIMED)
    others = [PERMISSION_OF[name] for name in ACTIONS if name != action]
    without = staff(*others)

    page = without.get(CHANGELIST)
    assert action not in [name for name, _ in page.context["action_form"].fields["action"].choices]
    run(without, action, record, apply="1", status="409", hours="1", reexecute="on")

    unchanged = IdempotencyRecord.objects.filter(pk=record.pk).values().first()
    assert unchanged is not None and unchanged["fencing_token"] == record.fencing_token
    assert unchanged["expires_at"] == record.expires_at
    assert not LogEntry.objects.exists()

    allowed = staff(PERMISSION_OF[action])
    choices = allowed.get(CHANGELIST).context["action_form"].fields["action"].choices
    assert action in [name for name, _ in choices]


def test_mark_failed_asks_for_the_response_then_stores_it(api: APIClient) -> None:
    post(api, "/api-view/charges", {"amount": 1}, "k")
    IdempotencyRecord.objects.update(
        state=State.UNCERTAIN, lease_expires_at=timezone.now() - timedelta(seconds=1)
    )
    record = IdempotencyRecord.objects.get()
    client = staff("mark_failed")

    form_page = run(client, "mark_failed", record)
    assert "HTTP status the client will get" in form_page.content.decode()
    assert IdempotencyRecord.objects.get().state == State.UNCERTAIN

    body = '{"detail": "Card declined.", "code": "card_declined"}'
    done = run(
        client,
        "mark_failed",
        record,
        apply="1",
        status="402",
        body=body,
        **{f"token-{record.pk}": record.fencing_token},
    )

    assert "1 record was marked failed." in done.content.decode()
    record.refresh_from_db()
    assert (record.state, record.response_status) == (State.FAILED, 402)
    replay = post(api, "/api-view/charges", {"amount": 1}, "k")
    assert (replay.status_code, replay.json()) == (402, json.loads(body))
    assert replay["Idempotent-Replayed"] == "true"
    entry = LogEntry.objects.get()
    assert entry.object_id == str(record.pk) and "402" in entry.get_change_message()


def test_mark_completed_stores_the_response_to_replay() -> None:
    record = stuck_record()
    client = staff("mark_completed")
    run(client, "mark_completed", record, apply="1", status="201", body='{"id": 9}')

    record.refresh_from_db()
    assert (record.state, record.response_status) == (State.COMPLETED, 201)
    assert json.loads(raw_body(record)) == {"id": 9}
    assert ["Content-Type", "application/json"] in record.response_headers


def test_a_record_changed_since_the_operator_looked_is_skipped() -> None:
    record = stuck_record()
    seen = record.fencing_token
    IdempotencyRecord.objects.filter(pk=record.pk).update(fencing_token=seen + 1)

    page = run(
        staff("mark_failed"),
        "mark_failed",
        record,
        apply="1",
        status="409",
        **{f"token-{record.pk}": seen},
    )

    assert "1 record was skipped" in page.content.decode()
    assert IdempotencyRecord.objects.get().state == State.UNCERTAIN


@pytest.mark.parametrize(
    ("state", "holder"),
    [(State.IN_PROGRESS, "web-1:4242:1"), (State.UNCERTAIN, "worker-1:99:1")],
    ids=["its-owner", "a-recovery-worker"],
)
def test_a_record_whose_lease_somebody_holds_is_left_to_them(state: str, holder: str) -> None:
    record = stuck_record(
        state=state, lease_owner=holder, lease_expires_at=timezone.now() + timedelta(minutes=1)
    )
    run(staff("mark_failed"), "mark_failed", record, apply="1", status="409")
    assert IdempotencyRecord.objects.get().state == state


def test_release_of_a_claim_needs_only_confirmation() -> None:
    record = stuck_record(state=State.CLAIMED)
    client = staff("release")

    assert "retry runs the operation" in run(client, "release", record).content.decode()
    run(client, "release", record, apply="1")

    assert not IdempotencyRecord.objects.exists()
    assert "Released (was CLAIMED)" in LogEntry.objects.get().get_change_message()


def test_release_past_the_claim_needs_the_explicit_warning_ticked() -> None:
    record = stuck_record(state=State.UNCERTAIN)
    client = staff("release")

    page = run(client, "release", record, apply="1")
    assert "EXECUTE THE OPERATION AGAIN" in page.content.decode()
    assert IdempotencyRecord.objects.exists()

    page = run(client, "release", record, apply="1", reexecute="on")
    assert not IdempotencyRecord.objects.exists()
    # The record this released is not also reported as gone since the list was shown.
    assert [str(message) for message in page.context["messages"]] == ["1 record was released."]


def test_extend_retention_never_shortens() -> None:
    near = RecordFactory.create(expires_at=timezone.now() + timedelta(hours=1))
    far = RecordFactory.create(expires_at=timezone.now() + timedelta(days=30))
    client = staff("extend")

    client.post(
        CHANGELIST,
        {
            "action": "extend_retention",
            "_selected_action": [near.pk, far.pk],
            "apply": "1",
            "hours": "48",
        },
    )

    near_after = IdempotencyRecord.objects.get(pk=near.pk).expires_at
    assert near_after > timezone.now() + timedelta(hours=47)
    assert IdempotencyRecord.objects.get(pk=far.pk).expires_at == far.expires_at
    assert LogEntry.objects.get().object_id == str(near.pk)  # the far one was not touched


@pytest.fixture
def reconciler() -> Iterator[None]:
    operation = "POST admin-test"

    @recovery.register_reconciler(operation)
    def settle(record: IdempotencyRecord) -> recovery.ReconcilerOutcome:
        return recovery.Completed(status=201, body={"settled": record.provider_key})

    yield
    del recovery._reconcilers[operation]


def test_reconcile_now_runs_the_operations_reconciler(reconciler: None) -> None:
    record = stuck_record(operation="POST admin-test", provider_key="pk_77")

    # Posted from the stuck filter, as an operator would: the record leaves
    # that list as it is settled.
    page = staff("reconcile").post(
        CHANGELIST + "?state=stuck",
        {"action": "reconcile_now", "_selected_action": [record.pk]},
        follow=True,
    )

    text = page.content.decode()
    assert "1 record was settled by its reconciler." in text
    assert "skipped" not in text
    record.refresh_from_db()
    assert record.state == State.COMPLETED
    assert json.loads(raw_body(record)) == {"settled": "pk_77"}
    assert "completed" in LogEntry.objects.get().get_change_message()


def test_a_record_resolved_since_the_operator_looked_is_not_released() -> None:
    record = stuck_record(state=State.IN_PROGRESS)
    seen = {f"token-{record.pk}": record.fencing_token, f"state-{record.pk}": "IN_PROGRESS"}
    # The slow owner completes meanwhile; owners' writes keep the token.
    IdempotencyRecord.objects.filter(pk=record.pk).update(state=State.COMPLETED)

    run(staff("release"), "release", record, apply="1", reexecute="on", **seen)

    assert IdempotencyRecord.objects.get().state == State.COMPLETED


def test_a_tampered_token_is_skipped_not_a_500() -> None:
    record = stuck_record()
    page = run(
        staff("mark_failed"),
        "mark_failed",
        record,
        apply="1",
        status="409",
        **{f"token-{record.pk}": "not-a-number"},
    )
    assert page.status_code == 200
    assert IdempotencyRecord.objects.get().state == State.UNCERTAIN


def test_reconcile_now_without_a_reconciler_says_the_record_stays_unresolved() -> None:
    record = stuck_record(operation="POST nobody-reconciles-this")
    text = run(staff("reconcile"), "reconcile_now", record).content.decode()

    assert "0 records were settled" in text
    assert "1 record stays unresolved" in text
    assert IdempotencyRecord.objects.get().state == State.UNCERTAIN


def test_search_is_exact_and_case_sensitive() -> None:
    record = RecordFactory.create(key="Order-ABC")
    client = staff()

    def found(term: str) -> bool:
        results = client.get(CHANGELIST, {"q": term}).context["cl"].result_list
        return record.pk in {r.pk for r in results}

    assert found("Order-ABC")
    assert not found("order-abc")
    assert not found("Order")


def test_the_date_hierarchy_links_the_range_of_expiry_dates() -> None:
    RecordFactory.create(expires_at=timezone.now() + timedelta(days=40))
    RecordFactory.create(expires_at=timezone.now() + timedelta(days=400))
    text = staff().get(CHANGELIST).content.decode()

    this_year = timezone.now().year
    for year in {this_year + 1, (timezone.now() + timedelta(days=40)).year}:
        assert f"expires_at__year={year}" in text


# --- Hand-made values: a 4xx or a skip, never a 500 ------------------------------


def superuser() -> Client:
    client = Client()
    client.force_login(UserFactory.create(is_staff=True, is_superuser=True))
    return client


@pytest.mark.parametrize(
    "query",
    [
        {"key__regex": ".*"},
        {"fingerprint__regex": "^a"},
        {"tenant__startswith": "user:"},
        {"provider_key__contains": "x"},
        {"response_body__isnull": "False"},
        {"expires_at__gte": "2020-01-01"},
        {"expires_at__month": "5"},  # the hierarchy's month, without its year
        {"state": "BOGUS"},
        {"state": "COMPLETED\x00"},
        {"expires": "week"},
        {"operation": "\x00"},
        {"operation": "POST " + "x" * 300},
        {"expires_at__year": "9999"},
        {"expires_at__year": "\u0662\u0660\u0662\u0667"},  # "2027" in Arabic-Indic digits
        {"expires_at__year": "2027", "expires_at__month": "13"},
        {"expires_at__year": "2027", "expires_at__month": "2", "expires_at__day": "30"},
        {"expires_at__year": "9" * 5000},
    ],
    ids=lambda query: "&".join(f"{name}={value[:12]!r}" for name, value in query.items()),
)
def test_a_lookup_the_admin_does_not_offer_is_refused_with_400(query: dict[str, str]) -> None:
    RecordFactory.create()
    assert superuser().get(CHANGELIST, query).status_code == 400


@pytest.mark.parametrize(
    "query",
    [
        {"state": "stuck"},
        {"state": "UNCERTAIN", "operation": "POST v1/payments", "expires": "day"},
        {"expires_at__year": "2027", "expires_at__month": "2", "expires_at__day": "28"},
        {"q": "k", "o": "-3", "p": "1"},
        {"e": "1"},
    ],
    ids=lambda query: ",".join(query)[:40],
)
def test_the_documented_filters_dates_search_order_and_pages_are_accepted(
    query: dict[str, str],
) -> None:
    RecordFactory.create()
    assert superuser().get(CHANGELIST, query).status_code == 200


@pytest.mark.parametrize(
    "term", ["\x00", "key\x00", "x" * 5000], ids=["nul", "nul-inside", "longer-than-any-column"]
)
def test_a_search_term_no_column_can_hold_is_refused_or_finds_nothing(term: str) -> None:
    RecordFactory.create(key="k")
    page = superuser().get(CHANGELIST, {"q": term})

    # Django's own search form refuses NUL with a message and searches for
    # nothing; a term longer than every column finds nothing.
    assert page.status_code == 200
    said = [str(message) for message in page.context["messages"]]
    assert said == ["Null characters are not allowed."] or (
        not said and list(page.context["cl"].result_list) == []
    )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("token", "\u0661\u0662\u0663"),  # "123" in Arabic-Indic digits: str.isdigit() is True
        ("token", "\uff11"),  # a fullwidth "1", the record's own token in other digits
        ("token", "9" * 5000),
        ("token", str(2**63)),  # past the PositiveBigIntegerField column
        ("token", "0"),
        ("state", "\x00"),
        ("state", "UNCERTAIN\x00"),
        ("state", "X" * 300),
    ],
    ids=[
        "arabic-digits",
        "fullwidth-own-token",
        "5000-digits",
        "2**63",
        "zero",
        "nul",
        "state-nul",
        "long-state",
    ],
)
@pytest.mark.parametrize("action", ["mark_failed", "release", "reconcile_now"])
def test_a_hand_made_token_or_state_in_an_action_form_is_skipped(
    action: str, field: str, value: str
) -> None:
    record = stuck_record(fencing_token=1)
    page = run(
        superuser(),
        action,
        record,
        apply="1",
        status="409",
        reexecute="on",
        **{f"{field}-{record.pk}": value},
    )

    assert page.status_code == 200
    assert "1 record was skipped" in page.content.decode()
    unchanged = IdempotencyRecord.objects.get()
    assert (unchanged.state, unchanged.fencing_token) == (State.UNCERTAIN, 1)


@pytest.mark.parametrize("selected", ["abc", "\x00", "9" * 5000, str(2**63), "\u0661"])
def test_a_hand_made_selection_is_not_a_500(selected: str) -> None:
    record = stuck_record()
    page = superuser().post(
        CHANGELIST,
        {"action": "mark_failed", "_selected_action": [selected], "apply": "1", "status": "409"},
        follow=True,
    )
    assert page.status_code in (200, 400)
    assert IdempotencyRecord.objects.get(pk=record.pk).state == State.UNCERTAIN


@pytest.mark.parametrize(
    "data",
    [{"status": "9" * 5000}, {"status": "409", "body": "\x00"}, {"status": "\x00"}],
    ids=["5000-digit-status", "nul-in-body", "nul-status"],
)
def test_a_hand_made_response_form_is_shown_again_not_applied(data: dict[str, str]) -> None:
    record = stuck_record()
    page = run(superuser(), "mark_failed", record, apply="1", **data)

    assert page.status_code == 200
    assert "HTTP status the client will get" in page.content.decode()  # the form, again
    assert IdempotencyRecord.objects.get().state == State.UNCERTAIN


@pytest.mark.parametrize(
    "path",
    [
        "?o=\x00",
        "?o=" + "9" * 5000,
        "?o=\u0661",
        "?p=\x00",
        "?p=" + "9" * 5000,
        "?p=99999",
        "?all=\x00",
        "?_to_field=fingerprint",
        "?_popup=1&_to_field=key",
        "?q=%00&state=stuck",
        "abc/change/",
        "%00/change/",
        "99999999999999999999/change/",
        "9223372036854775807/history/",
    ],
)
def test_no_hand_made_url_is_a_server_error(path: str) -> None:
    RecordFactory.create()
    assert superuser().get(CHANGELIST + path, follow=True).status_code < 500


# --- What a new user tripped on ---------------------------------------------------


def test_release_applied_without_the_tick_says_so_and_releases_nothing() -> None:
    record = stuck_record(state=State.UNCERTAIN)

    page = run(staff("release"), "release", record, apply="1")

    text = page.content.decode()
    assert '<p class="errornote">Please correct the error below.</p>' in text
    assert page.context["form"].errors == {
        "reexecute": ["Tick this box to release records past their claim: nothing was released."]
    }
    assert 'name="_apply"' in text  # the operator may still tick it and apply
    assert IdempotencyRecord.objects.filter(pk=record.pk).exists()
    assert not LogEntry.objects.exists()


def test_release_asked_for_the_first_time_shows_no_error() -> None:
    record = stuck_record(state=State.UNCERTAIN)

    page = run(staff("release"), "release", record)

    assert "errorlist" not in page.content.decode()
    assert "Please correct" not in page.content.decode()


@pytest.mark.parametrize("action", ["mark_failed", "mark_completed", "release", "extend_retention"])
def test_an_action_on_a_record_gone_since_the_list_says_so_and_offers_no_apply(
    action: str,
) -> None:
    record = stuck_record()
    IdempotencyRecord.objects.filter(pk=record.pk).delete()  # purged, or released elsewhere

    page = run(staff(*PERMISSION_OF.values()), action, record)

    text = page.content.decode()
    assert page.status_code == 200
    assert (
        "1 selected record no longer exists: it was released or purged since the list was shown."
        in text
    )
    assert 'name="_apply"' not in text
    assert "None of the selected records can take this action." not in text


def test_mark_failed_on_a_resolved_record_offers_no_apply() -> None:
    record = RecordFactory.create(state=State.COMPLETED)

    text = run(staff("mark_failed"), "mark_failed", record).content.decode()

    assert "None of the selected records can take this action." in text
    assert 'name="_apply"' not in text
    assert "no longer exists" not in text


def test_a_record_gone_between_the_page_and_apply_is_reported_gone() -> None:
    record = stuck_record()
    client = staff("mark_failed")
    assert 'name="_apply"' in run(client, "mark_failed", record).content.decode()
    IdempotencyRecord.objects.filter(pk=record.pk).delete()

    text = run(client, "mark_failed", record, apply="1", status="409").content.decode()

    assert "0 records were marked failed." in text
    assert (
        "1 selected record no longer exists: it was released or purged since the list was shown."
        in text
    )


@pytest.fixture
def releasing_reconciler() -> Iterator[str]:
    operation = "POST admin-test-release"

    @recovery.register_reconciler(operation)
    def never_charged(record: IdempotencyRecord) -> recovery.ReconcilerOutcome:
        return recovery.Release()

    yield operation
    del recovery._reconcilers[operation]


def test_reconcile_now_says_a_released_record_was_deleted_not_settled(
    releasing_reconciler: str,
) -> None:
    record = stuck_record(operation=releasing_reconciler)

    text = run(staff("reconcile"), "reconcile_now", record).content.decode()

    assert (
        "1 record was released: the operation did not happen, so the record is deleted "
        "and the client&#x27;s retry will run it again." in text
    )
    assert "settled" not in text
    assert "no longer exists" not in text  # the action deleted it: it is not news
    assert not IdempotencyRecord.objects.filter(pk=record.pk).exists()
    assert "released" in LogEntry.objects.get().get_change_message()


def test_reconcile_now_counts_as_gone_only_records_gone_before_it_ran(
    releasing_reconciler: str,
) -> None:
    """The record its reconciler released is deleted by the action itself: not "gone"."""
    released = stuck_record(operation=releasing_reconciler)
    purged = stuck_record(operation=releasing_reconciler)
    IdempotencyRecord.objects.filter(pk=purged.pk).delete()  # since the list was shown

    text = (
        staff("reconcile")
        .post(
            CHANGELIST,
            {"action": "reconcile_now", "_selected_action": [released.pk, purged.pk]},
            follow=True,
        )
        .content.decode()
    )

    assert "1 record was released: the operation did not happen" in text
    assert (
        "1 selected record no longer exists: it was released or purged since the list was shown."
        in text
    )


def test_reconcile_now_reports_settled_and_released_records_apart(
    reconciler: None, releasing_reconciler: str
) -> None:
    settled = stuck_record(operation="POST admin-test")
    released = stuck_record(operation=releasing_reconciler)
    claimed = stuck_record(state=State.CLAIMED)

    text = (
        staff("reconcile")
        .post(
            CHANGELIST,
            {"action": "reconcile_now", "_selected_action": [settled.pk, released.pk, claimed.pk]},
            follow=True,
        )
        .content.decode()
    )

    assert "1 record was settled by its reconciler." in text
    assert "2 records were released: their operations did not happen" in text
    assert list(IdempotencyRecord.objects.values_list("pk", flat=True)) == [settled.pk]


@pytest.mark.parametrize(
    ("use_tz", "shown"),
    # 03:04:05 UTC is 22:04:05 the day before in New York (EST, UTC-5);
    # without time zone support the stored time is New York's wall clock.
    [(True, "2030-01-01 22:04:05 EST"), (False, "2030-01-02 03:04:05 EST")],
    ids=["USE_TZ", "naive"],
)
def test_the_timeline_shows_the_lease_expiry_to_the_second_in_the_sites_time_zone(
    use_tz: bool, shown: str
) -> None:
    with override_settings(USE_TZ=use_tz, TIME_ZONE="America/New_York"):
        moment = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC if use_tz else None)
        record = stuck_record(lease_expires_at=moment)
        page = staff().get(f"{CHANGELIST}{record.pk}/change/")

    assert page.status_code == 200
    assert f"<th>lease expires</th><td>{shown}</td>" in page.content.decode()


@pytest.mark.parametrize("use_tz", [True, False], ids=["USE_TZ", "naive"])
def test_extend_retention_names_the_time_zone_of_the_time_it_reports(use_tz: bool) -> None:
    with override_settings(USE_TZ=use_tz, TIME_ZONE="America/New_York"):
        record = RecordFactory.create()
        page = run(staff("extend"), "extend_retention", record, apply="1", hours="1")
        kept = IdempotencyRecord.objects.get(pk=record.pk).expires_at
    # New York's wall clock either way: converted, or as stored.
    new_york = ZoneInfo("America/New_York")
    wall = kept.astimezone(new_york) if use_tz else kept.replace(tzinfo=new_york)

    said = f"{wall:%Y-%m-%d %H:%M:%S %Z}"
    text = page.content.decode()
    assert "UTC" not in text
    assert f"1 record will be kept until {said}." in text
    assert LogEntry.objects.get().get_change_message() == f"Retention extended to {said}."


def test_the_list_and_its_dates_work_without_time_zone_support() -> None:
    with override_settings(USE_TZ=False, TIME_ZONE="America/New_York"):
        RecordFactory.create(expires_at=datetime(2031, 5, 6, 7, 8, 9))
        page = staff().get(CHANGELIST)

    assert page.status_code == 200
    # One month of records: the date hierarchy offers its days.
    assert "expires_at__day=6&amp;expires_at__month=5&amp;expires_at__year=2031" in (
        page.content.decode()
    )


# -- steps (begin_external(step=...)) and the provider's id of a reconciled record ----------


def add_step(record: IdempotencyRecord, name: str, provider_operation_id: str = "") -> None:
    from django_idempotency.models import IdempotencyStep

    IdempotencyStep.objects.create(
        record=record,
        name=name,
        provider_key=f"v1:{name}-key",
        provider_operation_id=provider_operation_id,
        begun_at=timezone.now(),
        updated_at=timezone.now(),
    )


def test_the_change_page_lists_the_steps_in_begin_order_with_one_query() -> None:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    record = RecordFactory.create()
    add_step(record, "authorize", "au_1")
    add_step(record, "capture")
    client = staff()
    bare = RecordFactory.create()
    client.get(f"{CHANGELIST}{bare.pk}/change/")  # sessions, permissions: warmed

    with CaptureQueriesContext(connection) as without_steps:
        client.get(f"{CHANGELIST}{bare.pk}/change/")
    with CaptureQueriesContext(connection) as with_steps:
        text = client.get(f"{CHANGELIST}{record.pk}/change/").content.decode()

    assert text.index("authorize") < text.index("capture")
    assert "au_1" in text and "v1:capture-key" in text
    # The steps cost one query, whether there are any or not: never one per step.
    step_queries = [q for q in with_steps.captured_queries if "django_idempotency_step" in q["sql"]]
    assert len(step_queries) == 1
    assert len(with_steps.captured_queries) == len(without_steps.captured_queries)


def test_the_search_finds_a_record_by_a_steps_provider_operation_id_in_one_query() -> None:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    record = RecordFactory.create()
    add_step(record, "authorize", "au_77")
    add_step(RecordFactory.create(), "authorize", "au_78")
    client = staff()
    client.get(CHANGELIST + "?q=nothing")

    with CaptureQueriesContext(connection) as by_record:
        client.get(CHANGELIST + "?q=nothing")
    with CaptureQueriesContext(connection) as by_step:
        found = client.get(CHANGELIST + "?q=au_77").context["cl"].result_list

    assert [r.pk for r in found] == [record.pk]
    assert len(by_step.captured_queries) == len(by_record.captured_queries)


def test_a_record_settled_by_recovery_is_found_by_the_reconcilers_provider_id() -> None:
    operation = "POST admin-test/reconciled"

    @recovery.register_reconciler(operation)
    def reconciler(record: IdempotencyRecord) -> Any:
        return recovery.Completed(status=201, provider_operation_id="ch_settled")

    try:
        record = stuck_record(operation=operation)
        recovery.recover_stale_records()
    finally:
        recovery._reconcilers.pop(operation, None)

    found = staff().get(CHANGELIST + "?q=ch_settled").context["cl"].result_list
    assert [r.pk for r in found] == [record.pk]


def test_the_date_hierarchy_renders_for_another_model_admin_of_the_records() -> None:
    """The change list template is the records' whoever registers them: a plain
    ``ModelAdmin`` on a project's own admin site gets the date hierarchy of its list."""
    from django.contrib import admin
    from django.template.response import TemplateResponse
    from django.test import RequestFactory

    class PlainRecordAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
        date_hierarchy = "expires_at"

    site = admin.AdminSite(name="plain_records")
    site.register(IdempotencyRecord, PlainRecordAdmin)
    RecordFactory.create(expires_at=timezone.now() + timedelta(days=400))
    request = RequestFactory().get("/")
    request.user = UserFactory.create(is_staff=True, is_superuser=True)

    response = site._registry[IdempotencyRecord].changelist_view(request)
    assert isinstance(response, TemplateResponse)
    text = response.render().content.decode()

    assert f"expires_at__year={(timezone.now() + timedelta(days=400)).year}" in text
