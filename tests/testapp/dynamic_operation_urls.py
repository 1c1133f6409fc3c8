"""A view whose operation a callable names per request, next to a plain one."""

from __future__ import annotations

from django.urls import path

from tests.testapp.operation_urls import AnswerView


class PerTenantAnswerView(AnswerView):
    idempotency_operation = lambda request: f"answer for {request.headers['X-Tenant']}"  # noqa: E731


urlpatterns = [
    path("answers", AnswerView.as_view()),
    path("per-tenant/answers", PerTenantAnswerView.as_view()),
]
