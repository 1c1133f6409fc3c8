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
    # The format Prometheus asks for (its Accept header: OpenMetrics, or the
    # classic text format), with the Content-Type that names it.
    encode, content_type = choose_encoder(request.headers.get("Accept", ""))
    return HttpResponse(encode(registry), content_type=content_type)
