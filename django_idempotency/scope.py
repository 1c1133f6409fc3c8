"""Who is asking (tenant) and what for (operation): the key's namespace."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

from django.core.exceptions import ImproperlyConfigured
from django.utils.crypto import salted_hmac

from django_idempotency.models import OPERATION_MAX_LENGTH, TENANT_MAX_LENGTH

if TYPE_CHECKING:
    from django.http import HttpRequest

__all__ = [
    "DIGEST_PREFIX",
    "OperationSpec",
    "Scope",
    "credential_digest",
    "default_operation",
    "default_tenant",
    "digest",
    "resolve_operation",
    "resolve_tenant",
]

OperationSpec = None | str | Callable[["HttpRequest"], str]
"""What ``idempotent(operation=...)`` accepts: ``None``, a name, or a callable.

``None`` names the operation by the method plus the URL route pattern
(``"POST v1/payments"``); a callable takes the request and returns the name.
A name is 1 to 255 characters.
"""

#: Stored tenants that are digests of the real one start with this.
DIGEST_PREFIX = "sha256:"
_CREDENTIAL_SALT = "django_idempotency.scope.credential_digest"


@dataclass(frozen=True)
class Scope:
    """The (tenant, operation, key) triple that names one record.

    Passed to signal receivers as ``scope``, and ``request.idempotency.scope``.

    Attributes:
        tenant: Who asked, as ``IDEMPOTENCY["TENANT"]`` resolved it.
        operation: What for: the operation name.
        key: The client's ``Idempotency-Key``, unquoted.
    """

    tenant: str
    operation: str
    key: str


def default_tenant(request: HttpRequest) -> str:
    """The authenticated user, else the credential's user, else a digest of the credential.

    Never a credential itself: a DRF ``Token``'s primary key is its secret,
    and the tenant is shown in the admin and kept in the database.
    Anonymous clients share one key space; an API open to them should set
    ``IDEMPOTENCY["TENANT"]`` to something that tells them apart.

    Args:
        request: The request, after authentication.

    Returns:
        ``"user:<pk>"`` (the request's user, or the credential's),
        ``"application:<id>"`` (an OAuth application's token),
        ``"auth:<keyed digest>"`` (another credential with a primary key), or
        ``"anonymous"``.

    Raises:
        ImproperlyConfigured: The request is authenticated by a credential the
            default cannot tell apart from others (no primary key, no user):
            set ``IDEMPOTENCY["TENANT"]``.
    """
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated:
        if getattr(user, "pk", None) is None:
            _no_identity(user)  # every such user would be one tenant, "user:None"
        return f"user:{user.pk}"
    auth = getattr(request, "auth", None)
    # A token authenticating a client whose user is not (or not yet) the
    # request's user: the token's user is the client.
    user_id = getattr(auth, "user_id", None)
    if user_id is not None:
        return f"user:{user_id}"
    # An OAuth client-credentials token (django-oauth-toolkit's AccessToken):
    # the client is the application, whose tokens are renewed every few
    # hours; a retry with a fresh token is still the same client.
    application_id = getattr(auth, "application_id", None)
    if application_id is not None:
        return f"application:{application_id}"
    auth_id = getattr(auth, "pk", None)
    if auth_id is not None:
        return "auth:" + credential_digest(auth, auth_id)
    if auth is not None:
        _no_identity(auth)  # a JWT's claims, say: guessing would merge clients
    return "anonymous"


def _no_identity(credential: object) -> NoReturn:
    raise ImproperlyConfigured(
        f"The request is authenticated by a {type(credential).__name__} that the default "
        "tenant cannot tell apart from other clients (no primary key, no user). Set "
        'IDEMPOTENCY["TENANT"] to a function returning the client\'s stable identity.'
    )


def credential_digest(auth: object, auth_id: object) -> str:
    """A keyed digest (SECRET_KEY) of an auth object's identity.

    Stable for one credential and distinct between credentials, and without
    the server's secret no guess of the credential can be checked against
    it: a bare hash of a short API key would be reversible by trying keys.
    """
    # A model's label ("knox.AuthToken") survives moving its class.
    meta = getattr(auth, "_meta", None)
    kind = getattr(meta, "label", None) or f"{type(auth).__module__}.{type(auth).__qualname__}"
    return salted_hmac(_CREDENTIAL_SALT, f"{kind}:{auth_id}", algorithm="sha256").hexdigest()


#: What DRF's ``format_suffix_patterns`` (and so ``DefaultRouter``) appends to
#: a route, in regex and in path() form.
_FORMAT_SUFFIX = re.compile(
    r"(\\\.\(\?P<format>\[a-z0-9\]\+\)/\?\$|\.<drf_format_suffix\w*:format>)$"
)


def default_operation(request: HttpRequest) -> str:
    """``"POST v1/payments/<int:pk>/refunds"``: method plus URL route pattern.

    The pattern, not the path, so that one record namespace covers the
    endpoint and the URL arguments go into the fingerprint instead. A DRF
    format suffix and the pattern's end anchors are dropped, so that
    ``/payments/`` and ``/payments.json`` are one operation.
    """
    match = request.resolver_match
    route = match.route if match is not None and match.route else request.path
    route = _FORMAT_SUFFIX.sub("", route).rstrip("$").rstrip("/") or "/"
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
    if not isinstance(tenant, str):
        raise ImproperlyConfigured(
            f"IDEMPOTENCY['TENANT'] returned {tenant!r}; it must return a string."
        )
    if len(tenant) > TENANT_MAX_LENGTH or tenant.startswith(DIGEST_PREFIX):
        # Tenants may come from the client (a header, a subdomain): a long
        # one is stored by its digest rather than refused. A tenant that
        # merely looks like a digest is digested too, so that it can never
        # be mistaken for the long tenant whose digest it spells.
        return digest(tenant)
    return tenant


def digest(text: str) -> str:
    return DIGEST_PREFIX + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
