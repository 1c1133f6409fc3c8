from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView
from payments.ninja_api import api as ninja_api

urlpatterns = [
    path("admin/", admin.site.urls),
    path("v1/schema", SpectacularAPIView.as_view(), name="schema"),
    path("v1/", include("payments.urls")),
    # The refunds again, as a Django Ninja API (django_idempotency.ninja).
    path("ninja/v1/", ninja_api.urls),
    # GET /idempotency/status/?key=...: what became of a request, after a timeout.
    path("idempotency/", include("django_idempotency.urls")),
]
