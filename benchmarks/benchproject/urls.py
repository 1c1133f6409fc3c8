from __future__ import annotations

import os

from django.urls import path

from benchmarks.benchapp import async_views, views
from benchmarks.benchproject import telemetry

urlpatterns = [
    path("health", views.health),
    path("no-write", views.no_write),
    path("unprotected", views.unprotected),
    path("protected", views.protected),
    path("protected-optimistic", views.protected_optimistic),
    path("floor", views.floor),
    path("floor-lookup-first", views.floor_lookup_first),
    path("floor-optimistic", views.floor_optimistic),
    path("floor-single", views.floor_single),
    path("sync-unprotected", async_views.SyncUnprotected.as_view()),
    path("sync-mixin", async_views.SyncMixin.as_view()),
    path("async-unprotected", async_views.AsyncUnprotected.as_view()),
    path("async-mixin", async_views.AsyncMixin.as_view()),
]

if os.environ.get(telemetry.ENV):  # benchmarks/telemetry_cost.py's checks
    urlpatterns += [
        path("metrics", telemetry.metrics_view),
        path("telemetry", telemetry.telemetry_view),
    ]
