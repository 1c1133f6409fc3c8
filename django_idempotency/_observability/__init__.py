"""Observability: metrics, their two sinks, and tracing spans.

``recording`` turns what the protection, recovery and the purge did into
counts and timings for the configured sinks (``opentelemetry``,
``prometheus``), from the catalogue in ``django_idempotency.metrics``;
``tracing`` makes the OpenTelemetry spans and sets a request's or task
run's outcome on its span; ``checks`` validates the metrics settings. The
public view Prometheus scrapes is ``django_idempotency.prometheus``.

Imported by the request path, recovery, the purge and the Celery tasks;
it imports neither the request path's internals (``_protection``) nor the
admin. Private: its modules may change in any release.
"""
