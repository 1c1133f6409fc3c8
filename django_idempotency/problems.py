"""Refusals as RFC 9457 problem details (``application/problem+json``).

Chosen with ``IDEMPOTENCY["ERROR_FORMAT"] = "problem"``. The default,
``"drf"``, raises refusals for the project's own EXCEPTION_HANDLER instead.
"""

from __future__ import annotations

import json

from django.http import HttpResponse

from django_idempotency.conf import idempotency_settings
from django_idempotency.exceptions import IdempotencyRefusal

CONTENT_TYPE = "application/problem+json"


def problem_response(refusal: IdempotencyRefusal) -> HttpResponse:
    code = refusal.default_code
    detail = refusal.detail["detail"] if isinstance(refusal.detail, dict) else refusal.detail
    body = {
        "type": idempotency_settings.PROBLEM_TYPE_BASE + code,
        "title": str(refusal.default_detail).split(".")[0] + ".",
        "status": refusal.status_code,
        "detail": str(detail),
        "code": code,
    }
    response = HttpResponse(json.dumps(body), status=refusal.status_code, content_type=CONTENT_TYPE)
    wait = getattr(refusal, "wait", None)
    if wait:
        response["Retry-After"] = str(wait)
    return response
