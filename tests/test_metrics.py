"""The metrics, as an OpenTelemetry SDK's in-memory reader and prometheus_client see them."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from cryptography.fernet import Fernet
from django.db import connection, connections
from django.http import HttpRequest, JsonResponse
from django.test import Client
from django.urls import path
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt
from rest_framework.test import APIClient

from django_idempotency import idempotent, purge, recovery
from django_idempotency._observability import recording as metrics
from django_idempotency._protection import flow
from django_idempotency._store.database_time import DatabaseLater
from django_idempotency.metrics import INSTRUMENTS
from django_idempotency.models import IdempotencyRecord
from django_idempotency.tasks import observe_records
from tests.factories import RecordFactory
from tests.telemetry import Readings, installed
from tests.test_optimistic_duplicates import _commit_kills_the_session, _send
from tests.test_store_unavailable import unreachable_store  # noqa: F401  (a fixture)
from tests.testapp import optimistic_duplicate_views
from tests.testapp.models import Charge
from tests.utils import post

pytestmark = pytest.mark.django_db(transaction=True)

URL = "/api-view/charges"
OPERATION = "POST api-view/charges"
State = IdempotencyRecord.State


@pytest.fixture
def read() -> Callable[[], Readings]:
    reader, _ = installed()
    return lambda: Readings(reader)


@pytest.fixture
def counted(read: Callable[[], Readings]) -> Callable[..., float]:
    """How much an instrument's matching points rose since the test began."""
    before = read()

    def rise(name: str, **attributes: Any) -> float:
        return read().value(name, **attributes) - before.value(name, **attributes)

    return rise


def test_a_first_execution_and_its_replay_are_counted_by_outcome(
    api: APIClient, counted: Callable[..., float]
) -> None:
    post(api, URL, {"amount": 1}, "m-1")
    post(api, URL, {"amount": 1}, "m-1")
    post(api, URL, {"amount": 1}, "m-1")

    requests = "idempotency.requests"
    assert counted(requests, operation=OPERATION, outcome="executed") == 1
    assert counted(requests, operation=OPERATION, outcome="replayed") == 2
    assert counted("idempotency.protection.duration", operation=OPERATION) == 3


def test_metrics_count_the_outcome_whatever_the_signals_do(
    api: APIClient, counted: Callable[..., float], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The metrics read the request's outcome, not the signals: silenced, they still count."""
    from django_idempotency import signals

    monkeypatch.setattr(signals, "notify", lambda *args, **kwargs: None)
    post(api, URL, {"amount": 1, "status": 503}, "m-silent")
    post(api, URL, {"amount": 1}, "m-silent")
    post(api, URL, {"amount": 1}, "m-silent")

    requests = "idempotency.requests"
    assert counted(requests, operation=OPERATION, outcome="executed") == 2
    assert counted(requests, operation=OPERATION, outcome="replayed") == 1
    assert counted("idempotency.releases", operation=OPERATION, reason="status") == 1


def test_the_optimistic_mode_counts_its_execution_once(
    api: APIClient, counted: Callable[..., float]
) -> None:
    post(api, "/api-view/optimistic", {"amount": 1}, "m-opt")
    post(api, "/api-view/optimistic", {"amount": 1}, "m-opt")

    assert counted("idempotency.requests", outcome="executed") == 1
    assert counted("idempotency.requests", outcome="replayed") == 1


def test_refusals_are_counted_by_their_outcome(
    api: APIClient, counted: Callable[..., float]
) -> None:
    post(api, URL, {"amount": 1}, "m-2")
    assert post(api, URL, {"amount": 2}, "m-2").status_code == 422
    post(api, URL, {"amount": 1}, "m-busy")
    IdempotencyRecord.objects.filter(key="m-busy").update(
        state=State.CLAIMED,
        lease_owner="elsewhere:1:1",
        lease_expires_at=DatabaseLater(timedelta(minutes=5)),
    )
    assert post(api, URL, {"amount": 1}, "m-busy").status_code == 409
    assert post(api, URL, {"amount": 1}, None).status_code == 400

    assert counted("idempotency.requests", outcome="executed") == 2
    assert counted("idempotency.requests", outcome="key_reused") == 1
    assert counted("idempotency.requests", outcome="in_flight") == 1
    # Refused before it had a key: counted under its operation all the same.
    assert counted("idempotency.requests", operation=OPERATION, outcome="rejected") == 1


def test_a_key_past_retention_kept_as_a_tombstone_is_counted_expired(
    api: APIClient, counted: Callable[..., float], settings: Any
) -> None:
    settings.IDEMPOTENCY = {"TOMBSTONE_TTL": timedelta(days=7)}
    post(api, URL, {"amount": 5}, "m-late")
    IdempotencyRecord.objects.update(expires_at=DatabaseLater(-timedelta(hours=1)))

    assert post(api, URL, {"amount": 5}, "m-late").status_code == 422

    assert counted("idempotency.requests", outcome="key_expired") == 1


def test_releases_are_counted_by_reason(api: APIClient, counted: Callable[..., float]) -> None:
    with pytest.raises(Exception, match="failed after writing"):
        post(api, URL, {"amount": 1, "raise": True}, "m-raise")
    post(api, URL, {"amount": 1, "status": 503}, "m-503")

    assert counted("idempotency.releases", operation=OPERATION, reason="exception") == 1
    assert counted("idempotency.releases", operation=OPERATION, reason="status") == 1
    # The view ran each time: both requests executed, and are counted so.
    assert counted("idempotency.requests", outcome="executed") == 2


def test_an_uncertain_outcome_is_counted(api: APIClient, counted: Callable[..., float]) -> None:
    with pytest.raises(Exception, match="connection dropped"):
        post(api, "/api-view/external", {"amount": 1, "then": "raise"}, "m-unsure")

    assert counted("idempotency.uncertain", operation="POST api-view/external") == 1


@pytest.mark.usefixtures("unreachable_store")
def test_an_unreachable_store_is_counted(
    api: APIClient, counted: Callable[..., float], settings: Any
) -> None:
    assert post(api, URL, {"amount": 1}, "m-down").status_code == 503
    settings.IDEMPOTENCY = {**settings.IDEMPOTENCY, "FAIL_OPEN": True}
    assert post(api, URL, {"amount": 1}, "m-open").status_code == 201

    assert counted("idempotency.requests", outcome="store_unavailable") == 1
    assert counted("idempotency.requests", outcome="unprotected") == 1


@pytest.fixture
def operation() -> Iterator[str]:
    name = f"POST metrics-test/{uuid.uuid4().hex[:10]}"
    yield name
    recovery._reconcilers.pop(name, None)


def stale(state: str, operation: str) -> IdempotencyRecord:
    return RecordFactory.create(
        state=state,
        operation=operation,
        lease_owner="dead-host:1:1",
        lease_expires_at=timezone.now() - timedelta(minutes=1),
        response_status=None,
        response_body=None,
        provider_key=uuid.uuid4().hex,
    )


def test_recovery_is_counted_by_outcome(counted: Callable[..., float]) -> None:
    # A protected route's operation: recovery finds its name on the records.
    stale(State.CLAIMED, OPERATION)
    stale(State.UNCERTAIN, OPERATION)

    report = recovery.recover_stale_records()

    assert (report.released, report.unreconciled) == (1, 1)
    assert counted("idempotency.recovery", outcome="released") == 1
    assert counted("idempotency.recovery", outcome="unreconciled") == 1
    assert counted("idempotency.releases", operation=OPERATION, reason="recovery") == 1
    assert counted("idempotency.unreconciled", operation=OPERATION) == 1


def test_recovery_labels_an_operation_only_when_the_code_declares_it(
    operation: str, counted: Callable[..., float]
) -> None:
    """A name no route, literal, task or reconciler gives is "other"; a reconciler's is not."""
    stale(State.CLAIMED, operation)
    stale(State.UNCERTAIN, operation)
    recovery.recover_stale_records()
    assert counted("idempotency.releases", operation=operation) == 0
    assert counted("idempotency.releases", operation="other", reason="recovery") == 1
    assert counted("idempotency.unreconciled", operation="other") == 1

    recovery.register_reconciler(operation)(lambda record: recovery.Release())
    stale(State.UNCERTAIN, operation)
    recovery.recover_stale_records()
    assert counted("idempotency.releases", operation=operation, reason="reconciled") == 1


def test_the_purge_is_counted(counted: Callable[..., float]) -> None:
    past = timezone.now() - timedelta(hours=1)
    RecordFactory.create_batch(3, expires_at=past)

    assert purge.purge_expired_records(pause_factor=0).deleted == 3

    assert counted("idempotency.purged", database="default", action="deleted") == 3


def test_the_gauges_are_set_by_the_observe_task(
    operation: str, read: Callable[[], Readings]
) -> None:
    RecordFactory.create_batch(2, state=State.COMPLETED)
    RecordFactory.create(state=State.FAILED, expires_at=timezone.now() - timedelta(hours=1))
    stale(State.UNCERTAIN, operation)
    RecordFactory.create(
        state=State.UNCERTAIN,
        operation=operation,
        created_at=timezone.now() - timedelta(hours=2),
        response_status=None,
        response_body=None,
    )

    result = observe_records.run()

    readings = read()
    assert readings.value("idempotency.records", database="default", state="COMPLETED") == 2
    assert readings.value("idempotency.records", database="default", state="FAILED") == 1
    assert readings.value("idempotency.records", database="default", state="UNCERTAIN") == 2
    assert readings.value("idempotency.records", database="default", state="CLAIMED") == 0
    age = readings.value("idempotency.oldest_unresolved.age", database="default", state="UNCERTAIN")
    assert 2 * 3600 - 60 < age < 2 * 3600 + 600
    assert (
        readings.value("idempotency.oldest_unresolved.age", database="default", state="CLAIMED")
        == 0
    )
    assert readings.value("idempotency.purge.backlog", database="default") == 1
    assert readings.value("idempotency.unreconciled_operations", database="default") == 1
    assert readings.value("idempotency.census.timestamp", database="default") > 0
    assert result["default"]["unreconciled_operations"] == [operation]
    assert result["default"]["counts"]["UNCERTAIN"] == 2


def test_operations_past_the_cap_are_counted_as_other(
    api: APIClient, counted: Callable[..., float], settings: Any
) -> None:
    settings.IDEMPOTENCY = {"METRICS_OPERATIONS": 1}
    post(api, URL, {"amount": 1}, "m-cap-1")
    post(api, "/api-view/optimistic", {"amount": 1}, "m-cap-2")

    assert counted("idempotency.requests", operation=OPERATION, outcome="executed") == 1
    assert counted("idempotency.requests", operation="other", outcome="executed") == 1


@pytest.mark.urls("tests.testapp.dynamic_operation_urls")
def test_an_operation_a_callable_names_is_counted_as_other_unless_declared(
    counted: Callable[..., float],
) -> None:
    """Names made per request are unbounded; a reconciler's name is written in the code."""
    client = Client()
    for tenant in ("t1", "t2"):
        headers = {"Idempotency-Key": f"m-callable-{tenant}", "X-Tenant": tenant}
        assert client.post("/per-tenant/answers", headers=headers).status_code == 201
    assert counted("idempotency.requests", operation="other", outcome="executed") == 2
    assert counted("idempotency.requests", operation="answer for t1") == 0

    recovery.register_reconciler("answer for t3")(lambda record: recovery.Release())
    try:
        headers = {"Idempotency-Key": "m-callable-t3", "X-Tenant": "t3"}
        assert client.post("/per-tenant/answers", headers=headers).status_code == 201
    finally:
        recovery._reconcilers.pop("answer for t3")
    assert counted("idempotency.requests", operation="answer for t3", outcome="executed") == 1


def test_the_tenant_is_a_label_only_when_asked_and_the_key_never(
    api: APIClient, read: Callable[[], Readings], settings: Any
) -> None:
    post(api, URL, {"amount": 1}, "m-secret-key-1")
    assert not any("tenant" in labels for labels in read().labels("idempotency.requests"))

    settings.IDEMPOTENCY = {"METRICS_TENANT": True}
    post(api, URL, {"amount": 1}, "m-secret-key-2")

    labelled = read().labels("idempotency.requests")
    assert {"tenant": "anonymous"}.items() <= next(
        labels for labels in labelled if "tenant" in labels
    ).items()
    every_value = {value for labels in labelled for value in labels.values()}
    assert not any("secret-key" in str(value) for value in every_value)


def test_with_metrics_off_nothing_is_counted(
    api: APIClient, counted: Callable[..., float], settings: Any
) -> None:
    settings.IDEMPOTENCY = {"METRICS": ()}
    post(api, URL, {"amount": 1}, "m-off")
    post(api, URL, {"amount": 1}, "m-off")

    assert counted("idempotency.requests") == 0


def test_the_protection_time_leaves_the_views_time_out(
    api: APIClient, read: Callable[[], Readings], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A clock that the view moves on by 1,000 s: none of it is the protection's."""
    ticks = itertools.count()
    view_runs: list[float] = []
    clock = {"offset": 0.0}

    def perf_counter() -> float:
        return next(ticks) * 0.001 + clock["offset"]

    real_timed = flow._timed

    def timed(view: Callable[[], Any], tally: Any) -> Callable[[], Any]:
        def slow_view() -> Any:
            clock["offset"] += 1000.0
            view_runs.append(clock["offset"])
            return view()

        return real_timed(slow_view, tally)

    monkeypatch.setattr("django_idempotency._protection.outcome.time.perf_counter", perf_counter)
    monkeypatch.setattr(flow, "_timed", timed)
    before = read().matching("idempotency.protection.duration", {"outcome": "executed"})
    before_sum = sum(point.sum for point in before)

    post(api, URL, {"amount": 1}, "m-clock")

    after = read().matching("idempotency.protection.duration", {"outcome": "executed"})
    recorded = sum(point.sum for point in after) - before_sum
    assert view_runs == [1000.0]
    assert 0 < recorded < 1.0


def test_a_failing_sink_never_fails_the_request(
    api: APIClient, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    class Broken:
        def add(self, *args: Any) -> None:
            raise ConnectionError("metrics backend down")

        record = set = add

    monkeypatch.setattr(metrics, "sinks", lambda: (Broken(),))

    first = post(api, URL, {"amount": 1}, "m-broken")
    retry = post(api, URL, {"amount": 1}, "m-broken")

    assert (first.status_code, retry.status_code) == (201, 201)
    assert retry["Idempotent-Replayed"] == "true"
    assert "Metrics sink" in caplog.text


def test_prometheus_serves_the_same_counts_under_the_prometheus_names(
    api: APIClient, settings: Any
) -> None:
    from prometheus_client import REGISTRY

    settings.IDEMPOTENCY = {"METRICS": ("prometheus",)}

    def replayed() -> float:
        value = REGISTRY.get_sample_value(
            "idempotency_requests_total",
            {"operation": OPERATION, "outcome": "replayed", "tenant": ""},
        )
        return value or 0.0

    before = replayed()
    post(api, URL, {"amount": 1}, "m-prom")
    post(api, URL, {"amount": 1}, "m-prom")
    post(api, URL, {"amount": 1}, "m-prom")

    assert replayed() - before == 2
    page = Client().get("/metrics").content.decode()
    for instrument in INSTRUMENTS:
        assert f"# TYPE {instrument.prometheus_name} " in page, instrument.prometheus_name
    assert 'idempotency_requests_total{operation="POST api-view/charges",outcome="replayed"' in page


# Outcomes of requests answered 503.
#
# Every protected request is counted once, under the outcome it was
# answered with. These answers are 503s; they used to fall through to
# ``rejected``, which the docs define as refused input (no key, a key too
# long, a body too large), or stay ``executed``.

OUTCOMES = (
    "executed",
    "replayed",
    "key_reused",
    "key_expired",
    "in_flight",
    "store_unavailable",
    "outcome_uncertain",
    "unprotected",
    "rejected",
    "error",
)


def by_outcome(counted: Callable[..., float]) -> dict[str, float]:
    found = {outcome: counted("idempotency.requests", outcome=outcome) for outcome in OUTCOMES}
    return {outcome: amount for outcome, amount in found.items() if amount}


def test_a_replay_no_key_decrypts_is_counted_store_unavailable_not_rejected(
    api: APIClient, counted: Callable[..., float], settings: Any
) -> None:
    """The 503 ``idempotency_store_unavailable`` of an unreadable record.

    ``answers.answer_settled`` raises StoreUnavailable without sending
    ``store_unavailable``, so the request ends with no outcome and is
    counted ``rejected``: the 503 alert never sees it.
    """
    settings.IDEMPOTENCY = {"ENCRYPTION_KEYS": [Fernet.generate_key().decode()]}
    post(api, "/api-view/charges", {"amount": 1}, "r17-sealed")
    settings.IDEMPOTENCY = {"ENCRYPTION_KEYS": [Fernet.generate_key().decode()]}

    response = post(api, "/api-view/charges", {"amount": 1}, "r17-sealed")

    assert response.status_code == 503
    assert response.json()["code"] == "idempotency_store_unavailable"
    assert by_outcome(counted) == {"executed": 1, "store_unavailable": 1}


@pytest.mark.postgres
def test_an_optimistic_commit_lost_is_not_counted_as_refused_input(
    counted: Callable[..., float],
) -> None:
    """The view ran; whether its transaction committed is unknown (503 outcome_uncertain).

    The optimistic mode sends no signal before its record commits, so a
    connection lost at COMMIT leaves the request without an outcome and it
    is counted ``rejected``, as if its input had been refused.
    """
    with _commit_kills_the_session():
        lost = _send("/api-view/optimistic", {"amount": 1}, "k", {})
    assert lost.status_code == 503, lost.content

    counts = by_outcome(counted)
    assert counts == {"outcome_uncertain": 1}, counts


@csrf_exempt
@idempotent
def loses_its_connection(request: HttpRequest) -> JsonResponse:
    """The default mode's ``optimistic_duplicate_views.loses_its_connection``."""
    Charge.objects.create(tenant="metrics", amount=1)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(pg_backend_pid())")
    return JsonResponse({}, status=201)


urlpatterns = [
    path("default/loses-connection", loses_its_connection),
    path("optimistic/loses-connection", optimistic_duplicate_views.loses_its_connection),
]


@pytest.mark.postgres
@pytest.mark.urls(__name__)
@pytest.mark.parametrize("mode", ["default", "optimistic"])
def test_a_store_lost_mid_view_is_counted_store_unavailable(
    mode: str, counted: Callable[..., float]
) -> None:
    """503 ``idempotency_store_unavailable``: the view's writes went with its session.

    No ``store_unavailable`` signal is sent for it: the default mode counts
    it ``executed`` (the claim's outcome stays), the optimistic mode
    ``rejected`` (no outcome at all). The ``IdempotencyStoreUnavailable``
    alert and the dashboard's 503 panel miss the outage either way.
    """
    body = {"amount": 1, "terminate": True}
    lost = _send(f"/{mode}/loses-connection", body, "k", {})
    connections.close_all()
    assert lost.status_code == 503, lost.content
    assert lost.json()["code"] == "idempotency_store_unavailable"

    assert by_outcome(counted) == {"store_unavailable": 1}


@pytest.mark.parametrize("url", ["/api-view/charges", "/api-view/optimistic"])
def test_a_view_whose_success_was_rolled_back_is_not_counted_as_refused_input(
    url: str, api: APIClient, counted: Callable[..., float]
) -> None:
    """The view ran, swallowed an IntegrityError without a savepoint, answered 201: a 500.

    The default mode counts it ``executed`` (its claim was sent); the
    optimistic mode raises ``rolled_back_success`` with no signal before it,
    so the view's run is counted ``rejected``, refused input.
    """
    api.raise_request_exception = False
    body = {"amount": 1, "swallow_integrity_error": True}

    assert post(api, url, body, "r17-doomed").status_code == 500

    assert by_outcome(counted) == {"executed": 1}


#: docs/observability.md's values of ``idempotency_releases_total``'s ``reason``.
DOCUMENTED_RELEASE_REASONS = {"exception", "status", "store_unavailable", "recovery", "reconciled"}


@pytest.mark.postgres
@pytest.mark.urls(__name__)
def test_a_release_after_the_store_was_lost_has_a_documented_reason() -> None:
    """owned_run releases with ``reason="store unavailable"`` after a lost connection.

    ``metrics.note`` turns every non-int reason into a label as it is, so
    the series ``reason="store unavailable"`` appears: a value the docs,
    the signal's docstring, the alert rules and the dashboard do not know.
    """
    reader, _ = installed()
    lost = _send("/default/loses-connection", {"amount": 1}, "k", {})
    connections.close_all()
    assert lost.status_code == 503

    reasons = {labels.get("reason") for labels in Readings(reader).labels("idempotency.releases")}
    assert reasons <= DOCUMENTED_RELEASE_REASONS, reasons


def test_requests_are_counted_for_opentelemetry_only_once_a_meter_provider_is_set(
    api: APIClient, counted: Callable[..., float], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Until an SDK's meter provider is set the API drops every measurement: nothing is
    counted for it (no work for an observer nobody registered); from then on, everything."""
    from opentelemetry.metrics import _internal as api_internals

    provider = api_internals._METER_PROVIDER
    monkeypatch.setattr(api_internals, "_METER_PROVIDER", None)  # as before any is set
    assert not metrics.receiving()
    post(api, URL, {"amount": 1}, "m-unset")

    monkeypatch.setattr(api_internals, "_METER_PROVIDER", provider)  # set now
    assert metrics.receiving()
    post(api, URL, {"amount": 1}, "m-unset")

    requests = "idempotency.requests"
    assert counted(requests, operation=OPERATION, outcome="executed") == 0
    assert counted(requests, operation=OPERATION, outcome="replayed") == 1
