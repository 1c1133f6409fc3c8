"""The suite's URLs and ``/metrics`` (``tests.live.prometheus_settings``)."""

from __future__ import annotations

from django.urls import path

from django_idempotency.prometheus import metrics_view
from tests.testapp.urls import urlpatterns as testapp_urlpatterns

urlpatterns = [
    path("metrics", metrics_view),
    *testapp_urlpatterns,
]
