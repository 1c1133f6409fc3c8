"""Two views under one URL name: one operation name under OPERATION_NAMES="route_name"."""

from __future__ import annotations

from django.urls import path

from tests.testapp.operation_urls import AnswerView, api_view_answer

urlpatterns = [
    path("v1/answers", AnswerView.as_view(), name="answers"),
    path("v2/answers", api_view_answer, name="answers"),
]
