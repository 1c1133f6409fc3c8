"""The URLconf of tests/test_middleware_decorated_views.py: routes whose decorators matter."""

from __future__ import annotations

from django.contrib.auth.decorators import permission_required
from django.urls import path
from django.views.decorators.cache import never_cache
from django.views.decorators.csrf import csrf_exempt

from django_idempotency import idempotent_exempt
from tests.testapp import decorated_views as views
from tests.testapp.middleware_views import PaymentView

urlpatterns = [
    path(
        "api/gated/payments",
        permission_required(views.ADD_CHARGE, raise_exception=True)(PaymentView.as_view()),
    ),
    path("api/gated/function", views.gated_api_view),
    path("api/payments", PaymentView.as_view()),
    path("api/never-cache/payments", never_cache(PaymentView.as_view())),
    path("api/exempt-route/payments", idempotent_exempt(PaymentView.as_view())),
    path("api/csrf-exempt/payments", csrf_exempt(PaymentView.as_view())),
    path("api/dispatch-decorated", views.DispatchDecoratedAPIView.as_view()),
    path(
        "api/gated/exempt",
        idempotent_exempt(permission_required(views.ADD_CHARGE)(PaymentView.as_view())),
    ),
    path("api/under-idempotent", views.api_view_under_idempotent),
    path("api/method-decorated", views.MethodDecoratedAPIView.as_view()),
    path("api/method-decorated-options", views.MethodDecoratedWithOptionsAPIView.as_view()),
    path("api/get-only", views.GetOnlyAPIView.as_view()),
    path("api/durable", views.DurableBlockAPIView.as_view()),
    path("plain-api/method-decorated", csrf_exempt(views.MethodDecoratedPlainView.as_view())),
    path("plain-api/get-only", csrf_exempt(views.GetOnlyPlainView.as_view())),
]
