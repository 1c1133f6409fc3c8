"""The demo project's URLs plus one view for the partition test: ``POST /fleet/held``.

``held`` is ``@idempotent``: its view runs in a transaction on the
records' database (the one its outcome commits in) and locks its own
claimed record there first (``SELECT ... FOR UPDATE``), so the record's
row lock is held for as long as the view runs; it sleeps as many seconds
as the ``X-Fleet-Hold`` header says (at most 60) to keep it. A header,
not the body: a retry without it is the same request (headers are not
fingerprinted) and runs at once. A host cut off in that window leaves a
backend holding it on the server.
"""

from __future__ import annotations

import time

from django.urls import path
from rest_framework import status
from rest_framework.decorators import api_view
from rest_framework.request import Request
from rest_framework.response import Response
from testproject.urls import urlpatterns as demo_urlpatterns

from django_idempotency import idempotent
from django_idempotency.models import IdempotencyRecord


@api_view(["POST"])
@idempotent
def held(request: Request) -> Response:
    context = request.idempotency  # type: ignore[attr-defined]
    IdempotencyRecord.objects.using(context.database).select_for_update().filter(
        tenant=context.tenant, operation=context.operation, key=context.key
    ).exists()
    hold = min(float(request.headers.get("X-Fleet-Hold", 0)), 60.0)
    time.sleep(hold)
    return Response({"key": request.headers.get("Idempotency-Key")}, status=status.HTTP_201_CREATED)


urlpatterns = [*demo_urlpatterns, path("fleet/held", held)]
