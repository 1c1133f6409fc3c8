"""What a protected view decides once, not at every request: its ``Plan``.

A view's options and the ``IDEMPOTENCY`` settings fix where its key comes
from, whether it is echoed, which outcome policy applies, its retention,
its tenant resolver...: read through properties and settings descriptors,
these were about thirty calls per request. A plan holds them as plain
attributes, made at the view's first request and again at the first one
after ``setting_changed`` replaced the settings' resolved values (Django
sends it for ``override_settings`` and pytest-django's ``settings``), so a
changed setting takes effect at the next request, as it always did.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django.http.request import HttpHeaders
from rest_framework.request import Request

from django_idempotency._protection.keys import parse_key
from django_idempotency.conf import idempotency_settings

if TYPE_CHECKING:
    from django.http import HttpRequest

    from django_idempotency._protection.flow import Options
    from django_idempotency.outcomes import Outcome


#: A key that ``parse_key`` would return as it is: visible ASCII, no comma,
#: not quoted. Anything else (spaces around it, a quoted string, what it
#: refuses) goes through ``parse_key``.
_PLAIN_KEY = re.compile(r"[\x21\x23-\x2b\x2d-\x7e][\x21-\x2b\x2d-\x7e]*")


@dataclass(frozen=True, eq=False)
class Plan:
    """A view's options and the settings they depend on, resolved."""

    #: The settings' resolved values this plan was made from: it holds while
    #: they are the current ones.
    made_from: dict[str, Any]
    #: The key is the client's ``IDEMPOTENCY["HEADER"]`` header: echoed, and
    #: read here (``client_key``) rather than by the key source.
    client_header: bool
    #: That header's name, and its name in ``request.META``.
    header: str
    header_meta: str
    key_max_length: int
    required: bool
    tenant: Callable[[Any], str]
    retention: timedelta
    lease: timedelta
    outcome: Outcome
    credential_window: timedelta | None
    advertise_retention: bool

    def client_key(self, request: HttpRequest) -> str | None:
        """The key of the client's header, as ``KeySource.read`` reads it; None if absent."""
        meta = request._request.META if isinstance(request, Request) else request.META
        raw: str | None = meta.get(self.header_meta)
        if raw is None:
            return None
        if len(raw) <= self.key_max_length and _PLAIN_KEY.fullmatch(raw) is not None:
            return raw  # what parse_key returns for it, without its checks one by one
        return parse_key(raw, self.key_max_length)


def plan_of(options: Options) -> Plan:
    """``options``' plan under the current settings, made at its first use under them."""
    resolved = idempotency_settings.resolved
    plan: Plan | None = options.__dict__.get("_plan")
    if plan is None or plan.made_from is not resolved:
        plan = _made(options, resolved)
        # Options are frozen; the plan is what they mean, not one of them.
        object.__setattr__(options, "_plan", plan)
    return plan


def _made(options: Options, resolved: dict[str, Any]) -> Plan:
    conf = idempotency_settings
    header = conf.HEADER
    return Plan(
        made_from=resolved,
        client_header=options.key.is_client_header,
        header=header,
        header_meta=HttpHeaders.to_wsgi_name(header),
        key_max_length=conf.KEY_MAX_LENGTH,
        required=options.required if options.required is not None else conf.REQUIRED,
        tenant=options.tenant or conf.TENANT,
        retention=options.retention,
        lease=conf.LEASE,
        outcome=options.outcome_policy,
        credential_window=options.credential_window,
        advertise_retention=conf.ADVERTISE_RETENTION,
    )
