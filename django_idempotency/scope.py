"""Who is asking (tenant) and what for (operation): the key's namespace."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from django.core.exceptions import ImproperlyConfigured

from django_idempotency.models import OPERATION_MAX_LENGTH, TENANT_MAX_LENGTH

if TYPE_CHECKING:
    from django.http import HttpRequest

OperationSpec = None | str | Callable[["HttpRequest"], str]


@dataclass(frozen=True)
class Scope:
    """The (tenant, operation, key) triple that names one record."""

    tenant: str
    operation: str
    key: str


def default_tenant(request: HttpRequest) -> str:
    """The authenticated user, else the authenticating token, else anonymous.

    Anonymous clients share one key space; an API open to them should set
    ``IDEMPOTENCY["TENANT"]`` to something that tells them apart.
    """
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated:
        return f"user:{user.pk}"
    auth = getattr(request, "auth", None)
    token_id = getattr(auth, "pk", None)
    if token_id is not None:
        return f"token:{token_id}"
    return "anonymous"


def default_operation(request: HttpRequest) -> str:
    """``"POST v1/payments/<int:pk>/refunds"``: method plus URL route pattern.

    The pattern, not the path, so that one record namespace covers the
    endpoint and the URL arguments go into the fingerprint instead.
    """
    match = request.resolver_match
    route = match.route if match is not None and match.route else request.path
    return f"{request.method} {route}"


def resolve_operation(request: HttpRequest, spec: OperationSpec) -> str:
    if spec is None:
        name = default_operation(request)
    elif callable(spec):
        name = spec(request)
    else:
        name = spec
    if not name or len(name) > OPERATION_MAX_LENGTH:
        raise ImproperlyConfigured(
            f"The idempotent operation name {name!r} must be 1 to "
            f"{OPERATION_MAX_LENGTH} characters; pass a shorter operation=..."
        )
    return name


def resolve_tenant(request: HttpRequest, resolver: Callable[[HttpRequest], str]) -> str:
    tenant = resolver(request)
    if not isinstance(tenant, str) or len(tenant) > TENANT_MAX_LENGTH:
        raise ImproperlyConfigured(
            f"IDEMPOTENCY['TENANT'] returned {tenant!r}; it must return a string of "
            f"at most {TENANT_MAX_LENGTH} characters."
        )
    return tenant
