from __future__ import annotations

from django.urls import path

from benchmarks.benchapp import views

urlpatterns = [
    path("health", views.health),
    path("unprotected", views.unprotected),
    path("protected", views.protected),
    path("protected-single", views.protected_single),
    path("floor", views.floor),
    path("floor-single", views.floor_single),
]
