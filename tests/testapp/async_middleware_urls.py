"""The URLconf of the middleware's ASGI tests (tests/test_middleware_async.py).

adrf's async views and async plain views, none protecting itself but those
under ``own/``, and one sync DRF view beside them.
"""

from __future__ import annotations

from adrf.routers import SimpleRouter
from django.urls import include, path

from django_idempotency import idempotent_exempt
from tests.testapp import async_middleware_views as views
from tests.testapp import middleware_views

# adrf's router binds an async viewset's actions to its "a"-named handlers (acreate, ...).
router = SimpleRouter()
router.register("api/viewset/payments", views.PaymentViewSet, basename="async-payment")

urlpatterns = [
    path("api/payments", views.PaymentView.as_view()),
    path("api/generic/payments", views.PaymentCreateView.as_view()),
    path("api/function/payments", views.payment_api_view),
    path("api/guarded/payments", views.GuardedPaymentView.as_view()),
    path("api/exempt/class", views.ExemptView.as_view()),
    path("api/exempt/above", views.exempt_above_api_view),
    path("api/exempt/below", views.exempt_below_api_view),
    path("api/exempt/route", idempotent_exempt(views.PaymentView.as_view())),
    path("api/own/mixin", views.OwnMixinView.as_view()),
    path("api/own/method", views.OwnDecoratedMethodView.as_view()),
    path("api/own/decorator", views.own_decorator_api_view),
    path("api/sync/payments", middleware_views.PaymentView.as_view()),
    path("plain-api/charges", views.plain_charge),
    path("plain-api/class-charges", views.PlainChargeView.as_view()),
    path("plain-api/own", views.own_plain_charge),
    path("forms/charges", views.plain_charge),
    path("", include(router.urls)),
]
