"""Who is asking (tenant) and what for (operation): the key's namespace."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Literal, NoReturn

from django.core.exceptions import ImproperlyConfigured
from django.utils.crypto import salted_hmac

from django_idempotency._names import (
    OPERATION_MAX_LENGTH,
    TENANT_MAX_LENGTH,
    check_operation_spec,
    operation_name_fault,
    unprintable_character,
)
from django_idempotency.conf import idempotency_settings
from django_idempotency.exceptions import OperationInvalid

if TYPE_CHECKING:
    from django.http import HttpRequest

__all__ = [
    "ANONYMOUS_TENANT",
    "DIGEST_PREFIX",
    "OperationSpec",
    "Scope",
    "check_operation_spec",
    "credential_digest",
    "default_operation",
    "default_tenant",
    "digest",
    "normalised_route",
    "operation_name",
    "operation_name_fault",
    "resolve_operation",
    "resolve_tenant",
]

OperationSpec = None | str | Callable[["HttpRequest"], str]
"""What ``idempotent(operation=...)`` accepts: ``None``, a name, or a callable.

``None`` names the operation by the method plus the URL route pattern
(``"POST v1/payments"``); a callable takes the request and returns the name.
A name is 1 to 255 printable characters (``operation_name_fault``).
"""

ANONYMOUS_TENANT = "anonymous"
"""The tenant ``default_tenant`` gives every unauthenticated request: one shared key space."""

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
        ``ANONYMOUS_TENANT`` (``"anonymous"``).

    Raises:
        ImproperlyConfigured: The request is authenticated by a credential the
            default cannot tell apart from others (no primary key, no user):
            set ``IDEMPOTENCY["TENANT"]``.
    """
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated:
        return user_tenant(user)
    return credential_tenant(getattr(request, "auth", None))


def user_tenant(user: object) -> str:
    """``"user:<pk>"``: the tenant of an authenticated user (``default_tenant``'s, Ninja's)."""
    pk = getattr(user, "pk", None)
    if pk is None:
        _no_identity(user)  # every such user would be one tenant, "user:None"
    return f"user:{pk}"


def credential_tenant(auth: object) -> str:
    """The tenant of a credential object (a token model), or ``ANONYMOUS_TENANT`` for None.

    ``default_tenant``'s for a request authenticated without a user; the
    Ninja glue's for an authentication result that is no user.
    """
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
    return ANONYMOUS_TENANT


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

#: The values of ``IDEMPOTENCY["OPERATION_NAMES"]``.
OperationNames = Literal["pattern", "normalised", "route_name"]
OPERATION_NAMES: tuple[OperationNames, ...] = ("pattern", "normalised", "route_name")


def _route_of(request: HttpRequest) -> tuple[str, str, str | None]:
    """The request's method, route (its path if it has none) and route name."""
    # A DRF Request's own attributes are looked up through its __getattr__.
    django_request = getattr(request, "_request", request)
    match = django_request.resolver_match
    route = match.route if match is not None and match.route else django_request.path
    route_name = match.view_name if match is not None and match.url_name else None
    return str(request.method), route, route_name  # a DRF clone's method may be its own


@lru_cache(maxsize=1024)  # a route comes back on every request to it
def _judged_default_name(
    method: str, route: str, route_name: str | None, style: str
) -> tuple[str, str | None]:
    """The default name of the route's operation, and what is wrong with it, if anything."""
    name = operation_name(method, route, route_name, style)
    return name, operation_name_fault(name)


def default_operation(request: HttpRequest) -> str:
    """``"POST v1/payments/<int:pk>/refunds"``: method plus URL route pattern.

    The pattern, not the path, so that one record namespace covers the
    endpoint and the URL arguments go into the fingerprint instead. A DRF
    format suffix and the pattern's end anchors are dropped, so that
    ``/payments/`` and ``/payments.json`` are one operation.
    ``IDEMPOTENCY["OPERATION_NAMES"]`` may name it differently (see
    ``operation_name``).
    """
    return operation_name(*_route_of(request), idempotency_settings.OPERATION_NAMES)


def operation_name(method: str, route: str, route_name: str | None, style: str) -> str:
    """The default operation name of ``method`` on ``route`` in a naming ``style``.

    ``"pattern"``: the route as Django joined it (``PATCH
    api/orders/(?P<pk>[^/.]+)``). ``"normalised"``: its URL arguments as
    ``{name}`` (``PATCH api/orders/{pk}``), or the pattern when the route
    is more than literal text and arguments. ``"route_name"``: the URL's
    name with its namespaces (``PATCH api:orders-detail``), or the
    normalised name for a route without a name. Any other style names as
    ``"pattern"`` does: the names records and provider keys already have.
    """
    pattern = _FORMAT_SUFFIX.sub("", route).rstrip("$").rstrip("/") or "/"
    if style == "route_name" and route_name:
        return f"{method} {route_name}"
    if style in ("normalised", "route_name"):
        return f"{method} {normalised_route(pattern) or pattern}"
    return f"{method} {pattern}"


#: ``(?P<name>`` opening a named group.
_NAMED_GROUP = re.compile(r"\(\?P<(\w+)>")
#: A path() converter, ``<int:pk>`` or ``<pk>``, as Django's own parser reads it.
_PATH_PARAMETER = re.compile(r"<(?:[^>:]+:)?([^>]+)>")
#: Regex syntax that makes a route more than literal text and arguments.
_NOT_LITERAL = frozenset("[]{}()*+?|^$<>")


@lru_cache(maxsize=1024)  # a route comes back on every request to it
def normalised_route(pattern: str) -> str | None:
    """``^api/orders/(?P<pk>[^/.]+)`` as ``api/orders/{pk}``; None if it cannot be.

    Each capturing group and path() converter becomes ``{name}`` (an unnamed
    group ``{0}``, ``{1}``, ...), escaped characters become themselves, and a
    leading ``^`` goes. A route with other regex syntax (a character class,
    a repeated or optional part, an alternative, a non-capturing group)
    cannot be written as literal text: rather than a name that two routes
    could share, it has none, and keeps its pattern.
    """
    text = pattern.removeprefix("^")
    parts: list[str] = []
    unnamed = 0
    index = 0
    while index < len(text):
        char = text[index]
        if char == "\\":
            escaped = text[index + 1 : index + 2]
            if not escaped or escaped.isalnum():  # \d, \w, \b: classes and anchors
                return None
            parts.append(escaped)
            index += 2
        elif char == "(":
            end = _group_end(text, index)
            named = _NAMED_GROUP.match(text, index)
            if end is None or (named is None and text.startswith("(?", index)):
                return None
            if named is None:
                name, unnamed = str(unnamed), unnamed + 1
            else:
                name = named.group(1)
            parts.append("{" + name + "}")
            index = end + 1
            if text[index : index + 1] in ("?", "*", "+", "{"):
                return None
        elif char == "<":
            parameter = _PATH_PARAMETER.match(text, index)
            if parameter is None:
                return None
            parts.append("{" + parameter.group(1) + "}")
            index = parameter.end()
        elif char in _NOT_LITERAL:
            return None
        else:
            parts.append(char)
            index += 1
    return "".join(parts) or "/"


def _group_end(text: str, start: int) -> int | None:
    """The index of the ``)`` closing the group opened at ``start``."""
    depth = 0
    index = start
    while index < len(text):
        char = text[index]
        if char == "\\":
            index += 2
            continue
        if char == "[":
            index = _class_end(text, index)
        elif char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
            if depth == 0:
                return index
        index += 1
    return None


def _class_end(text: str, start: int) -> int:
    """The index of the ``]`` closing the character class opened at ``start``."""
    index = start + 1
    if text[index : index + 1] == "^":
        index += 1
    if text[index : index + 1] == "]":  # a leading ] is a literal
        index += 1
    while index < len(text) and text[index] != "]":
        index += 2 if text[index] == "\\" else 1
    return index


def resolve_operation(request: HttpRequest, spec: OperationSpec) -> str:
    """The request's operation name.

    Raises:
        OperationInvalid: The name computed for this request (its path, a
            callable's answer) is no operation name: the request is refused
            with 400 rather than failing at the claim.
        ImproperlyConfigured: A callable returned something other than a string.
    """
    if isinstance(spec, str):
        return spec  # checked when the view was decorated (check_operation_spec)
    if spec is None:
        name, fault = _judged_default_name(
            *_route_of(request), idempotency_settings.OPERATION_NAMES
        )
    else:
        name = spec(request)
        if not isinstance(name, str):
            function = getattr(spec, "__qualname__", repr(spec))
            raise ImproperlyConfigured(
                f"The operation callable {function} returned {name!r}; it must return a string."
            )
        fault = operation_name_fault(name)
    if fault is not None:
        # The name comes from the request (a path where the route has no
        # pattern; a callable reading the body): the client's to change.
        raise OperationInvalid(
            "This request cannot be made idempotent as it is: the operation name derived "
            f"from it (from its URL, or from its input) {fault}; an operation name is 1 to "
            f"{OPERATION_MAX_LENGTH} printable characters."
        )
    return name


def resolve_tenant(request: HttpRequest, resolver: Callable[[HttpRequest], str]) -> str:
    return checked_tenant(resolver(request), resolver)


def checked_tenant(tenant: object, resolver: Callable[[HttpRequest], str]) -> str:
    """``tenant``, what ``resolver`` returned, as a tenant column holds it.

    Raises:
        ImproperlyConfigured: ``tenant`` is not a string.
    """
    if not isinstance(tenant, str):
        name = getattr(resolver, "__qualname__", repr(resolver))
        raise ImproperlyConfigured(
            f"The tenant resolver {name} (IDEMPOTENCY['TENANT'], or a view's tenant=) "
            f"returned {tenant!r}; it must return a string."
        )
    if (
        len(tenant) > TENANT_MAX_LENGTH
        or tenant.startswith(DIGEST_PREFIX)
        or unprintable_character(tenant) is not None
    ):
        # Tenants may come from the client (a header, a subdomain): one the
        # column cannot hold as it is (too long; a NUL, which PostgreSQL
        # refuses; a control character, which would reach an operator's
        # terminal) is stored by its digest rather than refused, since the
        # project's resolver, not the client's request, chose it. Distinct
        # tenants keep distinct digests, and the status view, resolving the
        # tenant here too, finds the same record. A tenant that merely looks
        # like a digest is digested too, so that it can never be mistaken
        # for the tenant whose digest it spells.
        return digest(tenant)
    return tenant


def digest(text: str) -> str:
    return DIGEST_PREFIX + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
