"""The largest body a protected request may declare: ``MAX_FINGERPRINTED_BODY``.

Judged on the declared ``Content-Length``, before anything reads the body:
by the protection, before the key and the fingerprint are read, and by the
lookup for a refused retry (``refused``), which reads them too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rest_framework.request import Request

from django_idempotency.conf import idempotency_settings
from django_idempotency.exceptions import BodyTooLarge

if TYPE_CHECKING:
    from django.http import HttpRequest


def refuse_a_body_too_large(request: HttpRequest) -> None:
    """Raise ``BodyTooLarge`` for a declared body over ``MAX_FINGERPRINTED_BODY``."""
    limit = idempotency_settings.MAX_FINGERPRINTED_BODY
    if _declared_length(request) > limit:
        raise BodyTooLarge(
            f"The request body is larger than the {limit} bytes an idempotent request may have."
        )


def _declared_length(request: HttpRequest) -> int:
    """The body's length, as declared; 0 for multipart (uploads are hashed as streams)."""
    if (request.content_type or "").startswith("multipart/"):
        return 0
    # request.headers["Content-Length"], read where it comes from.
    meta = request._request.META if isinstance(request, Request) else request.META
    try:
        return int(meta.get("CONTENT_LENGTH") or 0)
    except ValueError:
        return 0
