"""The tenant of a request Django Ninja authenticated: named by its authentication result."""

from __future__ import annotations

from typing import TYPE_CHECKING

from django_idempotency._store.digests import tenant_digest
from django_idempotency.scope import credential_tenant, default_tenant, user_tenant

if TYPE_CHECKING:
    from django.http import HttpRequest

#: Tenants named by a keyed digest of a string credential start with this.
STRING_CREDENTIAL_PREFIX = "auth:"


def ninja_tenant(request: HttpRequest) -> str:
    """The client Ninja's authentication (``request.auth``) names, as ``default_tenant`` would.

    Ninja keeps what the operation's ``auth`` returned in ``request.auth``. A
    user (``django_auth``, or an ``authenticate()`` returning one) is
    ``"user:<pk>"``, the same tenant as through DRF; a token model is named
    as ``default_tenant`` names it; a string (an API key, a bearer token) is
    ``"auth:<version>:<keyed digest>"``: never the credential itself, which
    the tenant column would keep for the records' retention and the admin
    would show. An operation without authentication falls back on
    ``default_tenant`` (the session's user, else the anonymous tenant).

    Raises:
        ImproperlyConfigured: The result names nobody in particular (``True``,
            a dict of claims): set ``IDEMPOTENCY["TENANT"]``.
    """
    auth = getattr(request, "auth", None)
    if auth is None:
        return default_tenant(request)
    if isinstance(auth, str):
        return STRING_CREDENTIAL_PREFIX + tenant_digest(auth)
    if getattr(auth, "is_authenticated", False) is True:
        return user_tenant(auth)
    return credential_tenant(auth)
