"""The demo project's URLs plus one view for the partition test: ``POST /fleet/held``.

``held`` is ``@idempotent(single_transaction=True)``: its claim is an
uncommitted INSERT inside the view's own transaction, so the unique index
entry (the record's row lock, in effect) is held for as long as the view
runs; it sleeps as many seconds as the ``X-Fleet-Hold`` header says (at
most 60) to keep it. A header, not the body: a retry without it is the
same request (headers are not fingerprinted) and runs at once. A host cut off in
that window leaves a backend holding it on the server.
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


@api_view(["POST"])
@idempotent(single_transaction=True)
def held(request: Request) -> Response:
    hold = min(float(request.headers.get("X-Fleet-Hold", 0)), 60.0)
    time.sleep(hold)
    return Response({"key": request.headers.get("Idempotency-Key")}, status=status.HTTP_201_CREATED)


urlpatterns = [*demo_urlpatterns, path("fleet/held", held)]
