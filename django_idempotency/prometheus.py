"""A view for Prometheus to scrape: the ``"prometheus"`` metrics sink's values.

Set ``PROMETHEUS_MULTIPROC_DIR`` to an empty directory before gunicorn's
workers start, and in gunicorn's configuration::

    from prometheus_client import multiprocess

    def child_exit(server, worker):
        multiprocess.mark_process_dead(worker.pid)

Then route ``metrics_view`` where only Prometheus reaches it::

    path("metrics", django_idempotency.prometheus.metrics_view)

The sink itself (and why ``prometheus_client``'s multiprocess mode) is in
``django_idempotency/_observability/prometheus.py``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from django.http import HttpRequest, HttpResponse

# First: without the [prometheus] extra it raises ImproperlyConfigured naming it.
from django_idempotency._observability.prometheus import prometheus_sink  # isort: skip

import prometheus_client
from prometheus_client import multiprocess
from prometheus_client.exposition import choose_encoder

__all__ = ["metrics_view"]


def metrics_view(request: HttpRequest) -> HttpResponse:
    """Prometheus's text format: every process's values with ``PROMETHEUS_MULTIPROC_DIR``.

    Without that variable, this process's default registry (a single
    process: runserver, one worker, a Celery worker's own HTTP server),
    with whatever else the project registered there. In multiprocess mode
    only metrics are served (every process's counters, gauges, histograms
    and summaries, the project's too): ``prometheus_client`` cannot add up
    custom collectors, ``Info``, ``Enum`` or the process and platform
    collectors across processes, as with django-prometheus's view.
    """
    prometheus_sink()  # declared even before the first protected request
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = prometheus_client.CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    else:
        registry = prometheus_client.REGISTRY
    encode, content_type = _format_for(request.headers.get("Accept", ""))
    return HttpResponse(encode(registry), content_type=content_type)


def _format_for(accept: str) -> tuple[Callable[[Any], bytes], str]:
    """The format Prometheus asks for (OpenMetrics, or the classic text format), and its type.

    A version ``prometheus_client`` cannot read (``version=abc``: it compares
    the parts as numbers, and raises TypeError) gets the classic text format,
    as a header naming no known format does: a scraper's header is no
    reason for a 500.
    """
    try:
        return choose_encoder(accept)
    except (TypeError, ValueError):
        return choose_encoder("")
