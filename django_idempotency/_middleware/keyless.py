"""The report-only rollout: unsafe requests without a key, let through, counted and logged.

With ``MIDDLEWARE_KEYS = "report"`` a keyless request to a view the
middleware protects runs as routed, unprotected, as it did before the
middleware; ``note`` marks it in ``process_view`` and ``report`` counts
and logs it once it is answered (in a sync context: naming a plain view's
client may load its user), when the view has authenticated its
client (DRF authenticates inside the view, and hands the user and the
credential to the Django request). The count
(``idempotency_keyless_requests_total``, by operation) tells an operator
which operations still see such requests; the log line names who sends
them, as the tenant of a record names a client (``user:42``), never a
credential.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from django.core.exceptions import ImproperlyConfigured

from django_idempotency._middleware.coverage import left_alone_as_anonymous
from django_idempotency._ninja.tenant import ninja_tenant
from django_idempotency._observability import recording
from django_idempotency._protection.refused import principal_of
from django_idempotency.conf import idempotency_settings
from django_idempotency.scope import ANONYMOUS_TENANT, default_operation

if TYPE_CHECKING:
    from django.http import HttpRequest, HttpResponseBase

#: Its own logger, so that it can be routed, kept or silenced apart.
logger = logging.getLogger("django_idempotency.middleware")

_NOTED = "_idempotency_keyless"


@dataclass(frozen=True)
class Keyless:
    """A keyless request let through: its operation, named as its records would be."""

    operation: str
    #: The name is the route's, written in the code: a metrics label of its own.
    from_code: bool
    #: The framework that answers for the view (``RoutedView.framework``).
    framework: str = "django"


def note(request: HttpRequest, framework: str = "django") -> None:
    """Mark ``request`` as let through without a key (called in ``process_view``)."""
    match = request.resolver_match
    keyless = Keyless(
        default_operation(request), match is not None and bool(match.route), framework
    )
    setattr(request, _NOTED, keyless)


def noted(request: HttpRequest) -> bool:
    """Whether ``request`` was let through without a key (``note``): ``report`` has work to do."""
    return getattr(request, _NOTED, None) is not None


def report(request: HttpRequest, response: HttpResponseBase) -> None:
    """Count and log ``request`` if it was let through without a key, once it is answered.

    An anonymous request is not counted where the middleware leaves
    anonymous requests alone: a key would not protect it either.
    """
    keyless: Keyless | None = getattr(request, _NOTED, None)
    if keyless is None or left_alone_as_anonymous(request):
        return
    client = _client(request, keyless.framework)
    # A route's name is the code's; a path's (a route without a pattern) the client's.
    operation = keyless.operation if keyless.operation.isprintable() else ascii(keyless.operation)
    try:
        recording.count_keyless(keyless.operation, from_code=keyless.from_code)
    except Exception:  # counting must never replace the answer
        logger.exception("Counting a keyless request failed; the request goes on.")
    logger.info(
        "%s ran without an %s header, unprotected (IDEMPOTENCY['MIDDLEWARE_KEYS'] is "
        "'report'), sent by %s; answered %d.",
        operation,
        idempotency_settings.HEADER,
        client,
        response.status_code,
        extra={"idempotency_operation": operation, "idempotency_client": client},
    )


def _client(request: HttpRequest, framework: str) -> str:
    """The principal (``user:42``, ``application:7``, ``auth:<digest>``), never a credential."""
    if framework == "ninja":
        # Named by Ninja's authentication result, as its records' tenants are
        # (an API key by its keyed digest), not by the session's user.
        try:
            return ninja_tenant(request)
        except ImproperlyConfigured:
            return _UNNAMED
    principal = principal_of(request)
    if principal is not None:
        return principal
    if getattr(request, "auth", None) is None:
        return ANONYMOUS_TENANT
    return _UNNAMED


_UNNAMED = "a credential the default tenant cannot name (set IDEMPOTENCY['TENANT'])"
