"""System checks of the middleware: its place in ``MIDDLEWARE`` and its settings.

``MIDDLEWARE_KEYS`` (E051) and ``MIDDLEWARE_PLAIN_VIEW_PREFIXES`` (E052)
are validated with the other settings; ``check_middleware`` says when the
middleware is not last (E050), and when its settings are given while it
is not installed (W030). Registered by ``django_idempotency.checks``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Warning

from django_idempotency._checks import Validator, error
from django_idempotency._middleware.frameworks import MIDDLEWARE_PATH, position
from django_idempotency.conf import idempotency_settings

#: The settings that mean something only with the middleware installed.
MIDDLEWARE_SETTINGS = ("MIDDLEWARE_KEYS", "MIDDLEWARE_PLAIN_VIEW_PREFIXES")


def _check_keys(value: Any) -> Iterator[CheckMessage]:
    if value not in ("report", "required"):
        yield error(
            51,
            f"IDEMPOTENCY['MIDDLEWARE_KEYS'] = {value!r} is not 'report' or 'required'.",
            "'report' lets a request without an Idempotency-Key run unprotected and counts "
            "it (idempotency_keyless_requests_total) while clients move to keys; 'required' "
            "refuses it with 400 idempotency_key_missing.",
        )


def _check_prefixes(value: Any) -> Iterator[CheckMessage]:
    if (
        isinstance(value, str)
        or not isinstance(value, (list, tuple))
        or not all(isinstance(prefix, str) and prefix.startswith("/") for prefix in value)
    ):
        yield error(
            52,
            f"IDEMPOTENCY['MIDDLEWARE_PLAIN_VIEW_PREFIXES'] = {value!r} is not a list of "
            "path prefixes starting with '/'.",
            "List the URL path prefixes under which plain Django views are protected too, "
            "e.g. ['/api/'] (a list, even of one); [] for none. DRF views are protected "
            "wherever they are routed.",
        )


VALIDATORS: Mapping[str, Validator] = {
    "MIDDLEWARE_KEYS": _check_keys,
    "MIDDLEWARE_PLAIN_VIEW_PREFIXES": _check_prefixes,
}


def check_middleware(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """E050: the middleware is not last in MIDDLEWARE; W030: its settings, but not it."""
    middleware = list(getattr(settings, "MIDDLEWARE", None) or ())
    index = position()
    if index is None:
        given = [name for name in MIDDLEWARE_SETTINGS if name in idempotency_settings.user_settings]
        if not given:
            return []
        return [
            Warning(
                f"IDEMPOTENCY sets {' and '.join(given)}, but IdempotencyMiddleware is not in "
                "MIDDLEWARE: no view is protected by it.",
                hint=f"Add {MIDDLEWARE_PATH!r} last to MIDDLEWARE, or remove the setting.",
                id="django_idempotency.W030",
            )
        ]
    after = middleware[index + 1 :]
    if not after:
        return []
    return [
        error(
            50,
            f"IdempotencyMiddleware is not last in MIDDLEWARE: {', '.join(after)} "
            f"{'comes' if len(after) == 1 else 'come'} after it.",
            f"Move {middleware[index]!r} to the end of MIDDLEWARE. It answers a protected "
            "request from process_view(), by running the view itself, after DRF's "
            "authentication, permissions and throttles inside the view: the process_view() "
            "of a middleware after it (CsrfViewMiddleware's check, LoginRequiredMiddleware's) "
            "would not run for such a request, and a plain view's anonymous requests are "
            "told apart by the user AuthenticationMiddleware sets before it.",
        )
    ]
