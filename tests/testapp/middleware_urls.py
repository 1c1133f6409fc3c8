"""The URLconf of the middleware's tests (tests/test_middleware.py): no view here protects itself
but those under ``own/``."""

from __future__ import annotations

from django.contrib import admin
from django.urls import include, path
from rest_framework.authtoken.views import ObtainAuthToken
from rest_framework.routers import SimpleRouter

from django_idempotency import idempotent_exempt
from tests.testapp import middleware_views as views

router = SimpleRouter()
router.register("api/viewset/payments", views.PaymentViewSet, basename="payment")

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/payments", views.PaymentView.as_view()),
    path("api/guarded/payments", views.GuardedPaymentView.as_view()),
    path("api/generic/payments", views.PaymentCreateView.as_view()),
    path("api/function/payments", views.payment_api_view),
    path("api/exempt/class", views.ExemptView.as_view()),
    path("api/exempt/subclass", views.ExemptSubclassView.as_view()),
    path("api/exempt/above", views.exempt_above_api_view),
    path("api/exempt/below", views.exempt_below_api_view),
    path("api/exempt/route", idempotent_exempt(views.PaymentView.as_view())),
    path("api/token", ObtainAuthToken.as_view()),
    path("api/own/mixin", views.OwnMixinView.as_view()),
    path("api/own/decorator", views.own_decorator_api_view),
    path("api/probe", views.ProbeView.as_view()),
    path("api/function/probe", views.probe_api_view),
    path("api/held", views.HeldView.as_view()),
    path("plain-api/charges", views.plain_charge),
    path("plain-api/class-charges", views.PlainChargeView.as_view()),
    path("plain-api/exempt", views.exempt_plain_charge),
    path("plain-api/<str:version>/charges", views.versioned_plain_charge),
    path("forms/charges", views.plain_charge),
    path("many/", include("tests.testapp.many_views")),
    path("idempotency/", include("django_idempotency.urls")),
    path("", include(router.urls)),
]
