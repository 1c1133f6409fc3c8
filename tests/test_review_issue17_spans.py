"""Review of issue 17: spans that say "error" where nothing went wrong."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connections
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from rest_framework.test import APIClient

from tests.telemetry import Readings, installed
from tests.utils import post

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    _, exporter = installed()
    exporter.clear()
    yield exporter
    exporter.clear()


def _two_at_once(url: str, body: dict[str, Any], key: str) -> list[Any]:
    barrier = threading.Barrier(2)
    results: list[Any] = []

    def send() -> None:
        try:
            barrier.wait()
            results.append(post(APIClient(), url, body, key))
        finally:
            connections.close_all()

    threads = [threading.Thread(target=send) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


@pytest.mark.postgres
@pytest.mark.not_under(
    "atomic-requests", reason="single_transaction has no effect under ATOMIC_REQUESTS (W002)"
)
def test_a_duplicate_refused_409_in_a_single_transaction_is_no_error_span(
    exporter: InMemorySpanExporter, settings: Any
) -> None:
    """A duplicate that waited on the unique index for IN_FLIGHT_WAIT, then 409.

    In the default mode a 409 leaves every span UNSET. Here the lock
    timeout escapes ``step_span("idempotency.claim")`` (single_transaction.py)
    before it becomes the 409, so the claim span is an ERROR with the
    database's exception recorded: every routine duplicate shows as a
    failed claim in the trace backend's error views.
    """
    settings.IDEMPOTENCY = {"IN_FLIGHT_WAIT": 0.2}
    reader, _ = installed()
    before = Readings(reader).value("idempotency.requests", outcome="in_flight")

    results = _two_at_once("/api-view/single", {"amount": 1, "sleep": 1.0}, "r17-dup")

    assert sorted(r.status_code for r in results) == [201, 409]
    assert Readings(reader).value("idempotency.requests", outcome="in_flight") - before == 1
    errors = [
        (span.name, [event.attributes for event in span.events])
        for span in exporter.get_finished_spans()
        if span.name.startswith("idempotency.") and span.status.status_code is StatusCode.ERROR
    ]
    assert errors == []


@pytest.mark.postgres
@pytest.mark.not_under(
    "atomic-requests", reason="single_transaction has no effect under ATOMIC_REQUESTS (W002)"
)
def test_a_single_transaction_claim_span_says_what_the_docs_say(
    api: APIClient, exporter: InMemorySpanExporter
) -> None:
    """docs/observability.md: ``claimed`` (then ``idempotency.fencing_token``) or ``held``
    (then ``idempotency.record.state``).

    single_transaction.py sets only ``idempotency.outcome`` on its claim span.
    """
    post(api, "/api-view/single", {"amount": 1}, "r17-single")
    post(api, "/api-view/single", {"amount": 1}, "r17-single")

    claims = [
        dict(span.attributes or {})
        for span in exporter.get_finished_spans()
        if span.name == "idempotency.claim"
    ]
    claimed = [found for found in claims if found.get("idempotency.outcome") == "claimed"]
    held = [found for found in claims if found.get("idempotency.outcome") == "held"]
    assert claimed and held, claims
    assert all("idempotency.fencing_token" in found for found in claimed), claims
    assert all("idempotency.record.state" in found for found in held), claims
