"""``manage.py idempotency_routes``: each route and unsafe method, protected or not, and why.

What protects it (``IdempotencyMiddleware``, the view's ``@idempotent``, its
``IdempotentMixin``), under which operation name and with which options;
or why nothing does (``idempotent_exempt``, a view that issues credentials,
a plain view outside the prefixes, the middleware not installed). Read
from the URLconf as the middleware reads it at run time (``_routes``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from django_idempotency._middleware.coverage import ADD_DECORATOR, MIDDLEWARE, Coverage
from django_idempotency._middleware.frameworks import installed
from django_idempotency._protection.flow import Options
from django_idempotency._routes import RouteCoverage, route_coverage
from django_idempotency.conf import as_timedelta, idempotency_settings
from django_idempotency.management.terminal import printable
from django_idempotency.scope import operation_name

#: What a route whose view answers no unsafe method says.
SAFE_ONLY = "no unsafe method (GET, HEAD and OPTIONS are never protected)"


class Command(BaseCommand):
    help = (
        "List each URL route and unsafe method: protected (by IdempotencyMiddleware, "
        "@idempotent, IdempotentMixin or Ninja's add_decorator, with its operation name and "
        "options) or not, and why."
    )
    # What it lists is how to understand a failing check (E050): never refused for one.
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--format",
            choices=["text", "json"],
            default="text",
            help="text for a person, json for a program",
        )

    def handle(self, *args: Any, format: str, **options: Any) -> None:
        routes = list(route_coverage())
        if format == "json":
            self.stdout.write(json.dumps(_as_json(routes), indent=2))
            return
        for line in _summary():
            self.stdout.write(line)
        for route in routes:
            self.stdout.write("")
            self.stdout.write(f"{printable(route.route) or '/'}  ({printable(route.view)})")
            for methods, text in _method_lines(route):
                self.stdout.write(f"  {methods:<22}  {text}")


def _summary() -> Iterator[str]:
    """The middleware's settings, as they decide every route below."""
    if not installed():
        yield "IdempotencyMiddleware: not in MIDDLEWARE (views protect themselves, or are not)"
        return
    keys = idempotency_settings.MIDDLEWARE_KEYS
    yield (
        f"IdempotencyMiddleware: installed; MIDDLEWARE_KEYS = {keys!r}: "
        + (
            "a request without a key runs unprotected, counted and logged"
            if keys == "report"
            else "a request without a key is refused (400 idempotency_key_missing)"
        )
    )
    prefixes = idempotency_settings.MIDDLEWARE_PLAIN_VIEW_PREFIXES
    yield "Plain Django views protected under: " + (
        ", ".join(printable(prefix) for prefix in prefixes) if prefixes else "none"
    )
    if "TENANT" in idempotency_settings.user_settings:
        yield "Anonymous requests: protected, under IDEMPOTENCY['TENANT']"
    else:
        yield (
            "Anonymous requests: left alone by the middleware (IDEMPOTENCY['TENANT'] is not "
            "set: every anonymous client would share one key space)"
        )


def _method_lines(route: RouteCoverage) -> Iterator[tuple[str, str]]:
    """(methods, what protects them), consecutive methods left alone for one reason merged."""
    if not route.methods:
        yield "-", SAFE_ONLY
        return
    pending: list[str] = []
    reason = ""
    for method, coverage in route.methods:
        if coverage.by is None and pending and coverage.reason == reason:
            pending.append(method)
            continue
        if pending:
            yield " ".join(pending), f"not protected: {reason}"
            pending = []
        if coverage.by is None:
            pending, reason = [method], coverage.reason
        else:
            yield method, _protected(route, method, coverage)
    if pending:
        yield " ".join(pending), f"not protected: {reason}"


def _protected(route: RouteCoverage, method: str, coverage: Coverage) -> str:
    assert coverage.options is not None
    text = (
        f"protected by {_by(coverage)}, operation {printable(_operation(route, method, coverage))}"
    )
    described = _options(coverage.options)
    if coverage.by == MIDDLEWARE:
        described.pop("required", None)  # MIDDLEWARE_KEYS, said once above
    if described:
        text += "; " + ", ".join(f"{name}={value}" for name, value in described.items())
    if coverage.partial:
        text += " (where the path is under MIDDLEWARE_PLAIN_VIEW_PREFIXES)"
    return text


def _by(coverage: Coverage) -> str:
    if coverage.through == ADD_DECORATOR:
        return "a Router's or NinjaAPI's add_decorator"
    return {"middleware": "the middleware", "decorator": "@idempotent"}.get(
        str(coverage.by), "IdempotentMixin"
    )


def _operation(route: RouteCoverage, method: str, coverage: Coverage) -> str:
    assert coverage.options is not None
    spec = coverage.options.operation
    if spec is None:
        style = idempotency_settings.OPERATION_NAMES
        return operation_name(method, route.route or "/", route.route_name, style)
    if callable(spec):
        return f"computed per request by {_name(spec)}"
    return spec


def _options(options: Options) -> dict[str, Any]:
    """The options that differ from the defaults, as a person (and JSON) reads them."""
    described: dict[str, Any] = {}
    if options.required is not None:
        described["required"] = options.required
    if options.ttl is not None:
        described["ttl"] = _seconds(options.ttl)
    if options.optimistic:
        described["optimistic"] = True
    if not options.key.is_client_header:
        described["key"] = options.key.describe()
    fingerprint = options.fingerprint
    if fingerprint is not None:
        described["fingerprint"] = _name(fingerprint) if callable(fingerprint) else fingerprint
    for name in ("outcome", "tenant", "verify"):
        value = getattr(options, name)
        if value is not None:
            described[name] = _name(value)
    if options.credential_rotation is not None:
        described["credential_rotation"] = _seconds(options.credential_rotation)
    return described


def _seconds(duration: timedelta | float) -> str:
    return f"{as_timedelta(duration).total_seconds():g}s"


def _name(function: Any) -> str:
    return f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', function)}"


def _as_json(routes: list[RouteCoverage]) -> dict[str, Any]:
    return {
        "middleware": {
            "installed": installed(),
            "keys": idempotency_settings.MIDDLEWARE_KEYS,
            "plain_view_prefixes": list(idempotency_settings.MIDDLEWARE_PLAIN_VIEW_PREFIXES),
            "anonymous_protected": "TENANT" in idempotency_settings.user_settings,
        },
        "routes": [
            {
                "route": route.route,
                "name": route.route_name,
                "view": route.view,
                "framework": route.framework,
                "methods": [_method_json(route, method, cover) for method, cover in route.methods],
            }
            for route in routes
        ],
    }


def _method_json(route: RouteCoverage, method: str, coverage: Coverage) -> dict[str, Any]:
    if coverage.options is None or coverage.by is None:
        return {"method": method, "protected": False, "reason": coverage.reason}
    return {
        "method": method,
        "protected": True,
        "by": coverage.by,
        "operation": _operation(route, method, coverage),
        "options": _options(coverage.options),
        "partial": coverage.partial,
    }
