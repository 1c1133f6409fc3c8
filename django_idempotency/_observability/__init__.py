"""Observability: metrics, their two sinks, and tracing spans.

``metrics`` turns what the protection, recovery and the purge did into
counts and timings for the configured sinks (``opentelemetry``,
``prometheus``); ``tracing`` makes the OpenTelemetry spans. The public
view Prometheus scrapes is ``django_idempotency.prometheus``.

Imported by the request path, recovery, the purge and the Celery tasks;
it imports neither the request path's internals (``_protection``) nor the
admin. Private: its modules may change in any release.
"""
