"""The spans, as an OpenTelemetry SDK's in-memory exporter receives them."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connections
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from rest_framework.test import APIClient

from django_idempotency._observability.providers import tracer_provider_set
from tests.telemetry import installed
from tests.utils import post

pytestmark = pytest.mark.django_db(transaction=True)

URL = "/api-view/charges"
OPERATION = "POST api-view/charges"


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    _, exporter = installed()
    exporter.clear()
    yield exporter
    exporter.clear()


def ours(exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    return [span for span in exporter.get_finished_spans() if span.name.startswith("idempotency.")]


def request_span(api: APIClient, data: Any, key: str, url: str = URL) -> tuple[Any, int]:
    """POST under a span of the test's own, as the Django instrumentation opens one."""
    tracer = trace.get_tracer("tests")
    with tracer.start_as_current_span("POST", kind=SpanKind.SERVER) as parent:
        response = post(api, url, data, key)
    return parent, response.status_code


def test_a_first_execution_has_claim_view_and_complete_spans_under_the_request(
    api: APIClient, exporter: InMemorySpanExporter
) -> None:
    parent, status = request_span(api, {"amount": 1}, "t-1")

    assert status == 201
    spans = {span.name: span for span in ours(exporter)}
    assert set(spans) == {"idempotency.claim", "idempotency.view", "idempotency.complete"}
    for span in spans.values():
        assert span.parent is not None and span.parent.span_id == parent.get_span_context().span_id
        assert span.kind is SpanKind.INTERNAL
        assert span.attributes is not None
        assert span.attributes["idempotency.operation"] == OPERATION
    assert spans["idempotency.claim"].attributes == {
        "idempotency.operation": OPERATION,
        "idempotency.outcome": "claimed",
        "idempotency.fencing_token": 1,
    }
    assert spans["idempotency.complete"].attributes["idempotency.outcome"] == "COMPLETED"  # type: ignore[index]
    # In the order they ran: the claim, the view, then the completion (in the
    # view's transaction, which commits after it).
    claim, view, complete = (
        spans[name] for name in ("idempotency.claim", "idempotency.view", "idempotency.complete")
    )
    assert claim.end_time <= view.start_time  # type: ignore[operator]
    assert view.end_time <= complete.start_time  # type: ignore[operator]


def test_a_replay_has_a_claim_span_that_found_the_record_and_a_replay_span(
    api: APIClient, exporter: InMemorySpanExporter
) -> None:
    post(api, URL, {"amount": 1}, "t-2")
    exporter.clear()

    request_span(api, {"amount": 1}, "t-2")

    spans = {span.name: span for span in ours(exporter)}
    assert set(spans) == {"idempotency.claim", "idempotency.replay"}
    assert spans["idempotency.claim"].attributes["idempotency.outcome"] == "held"  # type: ignore[index]
    assert spans["idempotency.claim"].attributes["idempotency.record.state"] == "COMPLETED"  # type: ignore[index]
    assert spans["idempotency.replay"].attributes["http.response.status_code"] == 201  # type: ignore[index]


def test_begin_external_has_its_span_and_a_failing_view_is_an_error(
    api: APIClient, exporter: InMemorySpanExporter
) -> None:
    with pytest.raises(Exception, match="connection dropped"):
        request_span(api, {"amount": 1, "then": "raise"}, "t-3", url="/api-view/external")

    spans = {span.name: span for span in ours(exporter)}
    assert "idempotency.begin_external" in spans
    assert spans["idempotency.begin_external"].status.status_code is StatusCode.UNSET
    view = spans["idempotency.view"]
    assert view.status.status_code is StatusCode.ERROR
    assert any(event.name == "exception" for event in view.events)
    assert "idempotency.complete" not in spans


def test_a_step_is_named_on_its_begin_external_span(
    api: APIClient, exporter: InMemorySpanExporter
) -> None:
    request_span(api, {"steps": [{"name": "authorize"}]}, "t-steps", url="/api-view/steps")

    begun = [span for span in ours(exporter) if span.name == "idempotency.begin_external"]
    assert [span.attributes["idempotency.step"] for span in begun] == ["authorize"]  # type: ignore[index]


def test_no_span_carries_the_key(api: APIClient, exporter: InMemorySpanExporter) -> None:
    request_span(api, {"amount": 1}, "t-secret-key")
    request_span(api, {"amount": 1}, "t-secret-key")

    values = [value for span in ours(exporter) for value in (span.attributes or {}).values()]
    assert values and not any("secret-key" in str(value) for value in values)


def test_with_tracing_off_there_are_no_spans(
    api: APIClient, exporter: InMemorySpanExporter, settings: Any
) -> None:
    settings.IDEMPOTENCY = {"TRACING": False}

    request_span(api, {"amount": 1}, "t-off")

    assert ours(exporter) == []


def test_under_the_django_instrumentation_the_spans_are_children_of_the_request_span(
    exporter: InMemorySpanExporter,
) -> None:
    """opentelemetry-instrumentation-django opens the request's span; ours nest in it."""
    from opentelemetry.instrumentation.django import DjangoInstrumentor

    DjangoInstrumentor().instrument()
    try:
        # A client made after instrument(): the middleware is read when its handler loads.
        response = post(APIClient(), URL, {"amount": 1}, "t-django")
    finally:
        DjangoInstrumentor().uninstrument()

    assert response.status_code == 201
    finished = exporter.get_finished_spans()
    server = [span for span in finished if span.kind is SpanKind.SERVER]
    assert len(server) == 1, [span.name for span in finished]
    assert server[0].attributes is not None
    assert (
        server[0].attributes.get(
            "http.response.status_code", server[0].attributes.get("http.status_code")
        )
        == 201
    )
    children = {
        span.name
        for span in ours(exporter)
        if span.parent and span.parent.span_id == server[0].context.span_id
    }
    assert children == {"idempotency.claim", "idempotency.view", "idempotency.complete"}
    # Its span, started when the request was, ends saying what became of it.
    assert server[0].attributes["idempotency.request.outcome"] == "executed"


def _finished_request_span(exporter: InMemorySpanExporter) -> dict[str, Any]:
    (span,) = [span for span in exporter.get_finished_spans() if span.name == "POST"]
    return dict(span.attributes or {})


def test_the_request_span_carries_the_outcome_of_a_first_execution_and_its_replay(
    api: APIClient, exporter: InMemorySpanExporter
) -> None:
    request_span(api, {"amount": 1}, "t-outcome")
    first = _finished_request_span(exporter)
    exporter.clear()
    request_span(api, {"amount": 1}, "t-outcome")
    replay = _finished_request_span(exporter)

    assert first == {
        "idempotency.operation": OPERATION,
        "idempotency.request.outcome": "executed",
        "idempotency.replayed": False,
        "idempotency.record.state": "COMPLETED",
    }
    assert replay == {
        "idempotency.operation": OPERATION,
        "idempotency.request.outcome": "replayed",
        "idempotency.replayed": True,
    }
    assert "t-outcome" not in repr(first) + repr(replay)


def test_the_request_span_names_a_refusal_and_a_release(
    api: APIClient, exporter: InMemorySpanExporter
) -> None:
    request_span(api, {"amount": 1}, "t-refused")
    exporter.clear()
    request_span(api, {"amount": 2}, "t-refused")
    refused = _finished_request_span(exporter)
    exporter.clear()
    request_span(api, {"amount": 1, "status": 429}, "t-released")
    released = _finished_request_span(exporter)

    assert refused["idempotency.request.outcome"] == "key_reused"
    assert refused["idempotency.refusal"] == "idempotency_key_reused"
    assert released["idempotency.request.outcome"] == "executed"
    assert released["idempotency.release.reason"] == "status"
    assert "idempotency.record.state" not in released


def test_with_tracing_off_the_request_span_says_nothing_of_the_protection(
    api: APIClient, exporter: InMemorySpanExporter, settings: Any
) -> None:
    settings.IDEMPOTENCY = {"TRACING": False}

    request_span(api, {"amount": 1}, "t-off-request")

    assert _finished_request_span(exporter) == {}


def test_a_span_processor_that_raises_never_fails_the_request(
    api: APIClient, exporter: InMemorySpanExporter, caplog: pytest.LogCaptureFixture
) -> None:
    """A project's span processor failing as spans end: logged, and the request goes on.

    The claim span ends after the claim committed: a request failing there
    would leave its record claimed until the lease runs out.
    """
    from opentelemetry.sdk.trace import SpanProcessor, TracerProvider

    class Failing(SpanProcessor):
        def on_end(self, span: ReadableSpan) -> None:
            raise RuntimeError("the tracing backend is down")

    provider = trace.get_tracer_provider()
    assert isinstance(provider, TracerProvider)
    processors = provider._active_span_processor._span_processors
    provider._active_span_processor._span_processors = (*processors, Failing())
    try:
        first = post(api, URL, {"amount": 1}, "t-failing-processor")
        retry = post(api, URL, {"amount": 1}, "t-failing-processor")
    finally:
        provider._active_span_processor._span_processors = processors

    assert (first.status_code, retry.status_code) == (201, 201)
    assert retry["Idempotent-Replayed"] == "true"
    assert "span could not be ended" in caplog.text


# Spans must not say "error" where nothing went wrong.


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


def test_no_span_is_made_until_a_tracer_provider_is_set_and_each_one_after(
    api: APIClient, exporter: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without an SDK's provider the API would record nothing: nothing is made (no work for
    an observer nobody registered). Asked at every step, so a provider set later is used."""
    provider = trace.get_tracer_provider()
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", None)  # as before any is set
    assert not tracer_provider_set()

    unset = post(api, URL, {"amount": 1}, "t-unset")
    assert ours(exporter) == []

    monkeypatch.setattr(trace, "_TRACER_PROVIDER", provider)  # set now
    assert tracer_provider_set()
    replayed = post(api, URL, {"amount": 1}, "t-unset")

    assert (unset.status_code, replayed.status_code) == (201, 201)
    assert [span.name for span in ours(exporter)] == ["idempotency.claim", "idempotency.replay"]
