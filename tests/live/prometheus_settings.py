"""``tests.settings`` with the Prometheus sink on.

For tests/live/test_prometheus_scrape.py: gunicorn serves the suite's views
with ``IDEMPOTENCY["METRICS"] = ("prometheus",)``;
``django_idempotency.prometheus.metrics_view`` is at ``/metrics`` in
``tests.testapp.urls``. ``PROMETHEUS_MULTIPROC_DIR``, set by the test, makes
every worker write its counters there and the view read them all,
whichever worker answers the scrape.
"""

from __future__ import annotations

from tests.settings import *  # noqa: F403

IDEMPOTENCY = dict(globals().get("IDEMPOTENCY", {}))
IDEMPOTENCY["METRICS"] = ("prometheus",)
