"""Plain Django views for the ``csrf-real-server`` configuration: forms with CSRF tokens.

The suite's ROOT_URLCONF plus a protected view that reads ``request.POST``
(urlencoded or multipart, as HTML forms send them) and a view that hands
out a CSRF token (and its cookie). ``CsrfViewMiddleware`` enforces on both:
neither is exempt.
"""

from __future__ import annotations

from django.http import HttpRequest, JsonResponse
from django.middleware.csrf import get_token
from django.urls import include, path

from django_idempotency import idempotent
from tests.testapp.models import Charge


def csrf_token(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"token": get_token(request)})


@idempotent
def form_charges(request: HttpRequest) -> JsonResponse:
    charge = Charge.objects.create(
        tenant="anonymous",
        amount=int(request.POST.get("amount", "0")),
        note=request.POST.get("note", ""),
    )
    return JsonResponse({"id": charge.pk, "amount": charge.amount}, status=201)


urlpatterns = [
    path("forms/csrf-token", csrf_token),
    path("forms/charges", form_charges),
    path("", include("tests.testapp.urls")),
]
