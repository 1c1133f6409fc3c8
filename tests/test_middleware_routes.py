"""What lists the protected views knows the middleware's: checks, metrics, schema, the command.

The system checks (W002 under ATOMIC_REQUESTS, W004 for a reconciler's
operation), the metrics' operation labels, the drf-spectacular schema and
``manage.py idempotency_routes`` all read the URLconf as the middleware
does, and say nothing of it where it is not installed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from io import StringIO
from typing import Any

import pytest
from django.conf import settings as django_settings
from django.core.management import call_command
from drf_spectacular.generators import SchemaGenerator
from rest_framework import permissions, views

from django_idempotency import recovery
from django_idempotency._middleware.drf import admits_anonymous
from django_idempotency._observability import labels
from django_idempotency._routes import protected_operations
from django_idempotency.checks import check_atomic_requests, check_operations
from django_idempotency.models import IdempotencyRecord
from django_idempotency.recovery import Completed

MIDDLEWARE = "django_idempotency.middleware.IdempotencyMiddleware"
BASE = tuple(django_settings.MIDDLEWARE)
URLCONF = "tests.testapp.middleware_urls"


def configure(settings: Any, *, installed: bool = True, **idempotency: Any) -> None:
    settings.MIDDLEWARE = [*BASE, MIDDLEWARE] if installed else list(BASE)
    settings.ROOT_URLCONF = URLCONF
    settings.IDEMPOTENCY = {"MIDDLEWARE_PLAIN_VIEW_PREFIXES": ["/plain-api/"], **idempotency}


@pytest.fixture
def middleware(settings: Any) -> None:
    configure(settings)


@pytest.fixture
def no_middleware(settings: Any) -> None:
    configure(settings, installed=False)


# -- the operations the checks and the metrics know ---------------------------------------

MIDDLEWARE_OPERATIONS = {
    "POST api/payments",
    "PUT api/payments",
    "DELETE api/payments",
    "POST api/generic/payments",
    "POST api/function/payments",
    "POST ^api/viewset/payments",
    "PATCH ^api/viewset/payments/(?P<pk>[^/.]+)",
    "POST ^api/viewset/payments/(?P<pk>[^/.]+)/refund",
    "POST plain-api/charges",
    "POST plain-api/class-charges",
    "POST many/views/19",
    "DELETE many/sets/9/(?P<pk>[^/.]+)",
}
LEFT_ALONE = {
    "POST api/exempt/class",
    "POST api/exempt/subclass",
    "POST api/exempt/above",
    "POST api/exempt/below",
    "POST api/exempt/route",
    "POST ^api/viewset/payments/(?P<pk>[^/.]+)/note",
    "POST api/token",
    "POST forms/charges",
    "POST plain-api/exempt",
    "POST admin/login",
}


def test_the_protected_operations_include_the_middlewares(middleware: None) -> None:
    operations = protected_operations()

    assert operations >= MIDDLEWARE_OPERATIONS
    assert not operations & LEFT_ALONE
    # The views that protect themselves keep their own names.
    assert {"own-mixin-payment", "own-decorator-payment"} <= operations
    assert "POST api/own/mixin" not in operations


def test_without_the_middleware_only_views_that_protect_themselves_are(
    no_middleware: None,
) -> None:
    assert protected_operations() == {"own-mixin-payment", "own-decorator-payment"}


def test_a_middleware_operation_is_a_metrics_label_for_recovery_too(settings: Any) -> None:
    """Recovery counts by the names on records (not from code): those the URLconf declares."""
    configure(settings, installed=False)
    assert labels.operation_label("PATCH api/payments/unknown") == labels.OTHER
    assert labels.operation_label("PUT api/payments") == labels.OTHER

    configure(settings)
    assert labels.operation_label("PUT api/payments") == "PUT api/payments"


@pytest.fixture
def reconciler_for(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], None]:
    monkeypatch.setattr(recovery, "_reconcilers", {})

    def register(operation: str) -> None:
        def settle(record: IdempotencyRecord) -> Completed:
            return Completed(status=200)

        recovery.register_reconciler(operation)(settle)

    return register


def test_a_reconciler_of_a_middleware_operation_is_not_warned_about(
    settings: Any, reconciler_for: Callable[[str], None]
) -> None:
    reconciler_for("DELETE api/payments")

    configure(settings)
    assert check_operations() == []

    configure(settings, installed=False)
    assert [message.id for message in check_operations()] == ["django_idempotency.W004"]


def test_under_atomic_requests_only_the_views_that_protect_themselves_are_warned_about(
    middleware: None, atomic_requests: None
) -> None:
    flagged = sorted(str(message.msg).split("'")[1] for message in check_atomic_requests())

    # @api_view with @idempotent has no hook to be exempted; the middleware's
    # @api_view functions run its own class, which is.
    assert flagged == ["api/own/decorator"]


# -- the OpenAPI schema ------------------------------------------------------------------


def schema() -> dict[str, Any]:
    generator = SchemaGenerator(urlconf=URLCONF)  # type: ignore[no-untyped-call]
    generated: dict[str, Any] = generator.get_schema(request=None, public=True)  # type: ignore[no-untyped-call]
    return generated


def key_header(operation: dict[str, Any]) -> dict[str, Any] | None:
    return next(
        (
            parameter
            for parameter in operation.get("parameters", [])
            if parameter["in"] == "header" and parameter["name"] == "Idempotency-Key"
        ),
        None,
    )


PROTECTED_IN_THE_SCHEMA = [
    ("/api/payments", "post"),
    ("/api/payments", "delete"),
    ("/api/generic/payments", "post"),
    ("/api/function/payments", "post"),
    ("/api/viewset/payments/", "post"),
    ("/api/viewset/payments/{id}/", "patch"),
    ("/api/viewset/payments/{id}/refund/", "post"),
    ("/many/views/7", "post"),
]
UNPROTECTED_IN_THE_SCHEMA = [
    ("/api/payments", "get"),
    ("/api/exempt/class", "post"),
    ("/api/exempt/above", "post"),
    ("/api/exempt/below", "post"),
    ("/api/viewset/payments/{id}/note/", "post"),
    ("/api/token", "post"),
    ("/api/exempt/route", "post"),
]


def one_tenant(request: Any) -> str:
    return "everyone"


@pytest.mark.parametrize(("keys", "required"), [("report", False), ("required", True)])
def test_the_schema_shows_the_header_and_refusals_of_middleware_protected_operations(
    settings: Any, keys: str, required: bool
) -> None:
    # With a TENANT, anonymous callers are protected too: "required" holds for all.
    configure(settings, MIDDLEWARE_KEYS=keys, TENANT=one_tenant)
    paths = schema()["paths"]

    for path, method in PROTECTED_IN_THE_SCHEMA:
        operation = paths[path][method]
        header = key_header(operation)
        assert header is not None, (path, method)
        assert header.get("required", False) is required
        assert {"409", "422"} <= set(operation["responses"]), (path, method)
    for path, method in UNPROTECTED_IN_THE_SCHEMA:
        operation = paths[path][method]
        assert key_header(operation) is None, (path, method)
        assert "422" not in operation["responses"], (path, method)


ANONYMOUS_NOTE = "Requests without authentication are not protected"


def test_with_required_keys_the_key_is_required_only_where_a_keyless_request_is_refused(
    settings: Any,
) -> None:
    """Without TENANT the middleware runs anonymous requests unprotected: AllowAny lets them in."""
    configure(settings, MIDDLEWARE_KEYS="required")
    paths = schema()["paths"]

    for path, method in PROTECTED_IN_THE_SCHEMA:  # AllowAny, the tests' default
        header = key_header(paths[path][method])
        assert header is not None, (path, method)
        assert header.get("required", False) is False, (path, method)
        assert ANONYMOUS_NOTE in header["description"], (path, method)
    guarded = key_header(paths["/api/guarded/payments"]["post"])  # IsAuthenticated
    assert guarded is not None and guarded["required"] is True
    assert ANONYMOUS_NOTE not in guarded["description"]
    # The view's own protection claims anonymous requests too, under one tenant.
    own = key_header(paths["/api/own/mixin"]["post"])
    assert own is not None and ANONYMOUS_NOTE not in own["description"]


@pytest.mark.django_db(transaction=True)
def test_with_required_keys_the_schema_says_what_a_keyless_request_meets(
    settings: Any, client: Any, django_user_model: Any
) -> None:
    configure(settings, MIDDLEWARE_KEYS="required")
    paths = schema()["paths"]
    body = {"content_type": "application/json", "data": {"amount": 5}}

    anonymous = client.post("/api/payments", **body)
    client.force_login(django_user_model.objects.create(username="payer"))
    authenticated = client.post("/api/guarded/payments", **body)

    open_header = key_header(paths["/api/payments"]["post"])
    guarded_header = key_header(paths["/api/guarded/payments"]["post"])
    assert open_header is not None and guarded_header is not None
    assert open_header.get("required", False) is False
    assert anonymous.status_code == 201
    assert guarded_header.get("required", False) is True
    assert (authenticated.status_code, authenticated.json()["code"]) == (
        400,
        "idempotency_key_missing",
    )


@pytest.mark.parametrize(
    ("permission_classes", "authentication_classes", "admitted"),
    [
        ([permissions.AllowAny], None, True),
        ([], None, True),
        ([permissions.IsAuthenticated], None, False),
        ([permissions.IsAuthenticated], [], True),  # no authentication: every caller anonymous
        ([permissions.IsAdminUser], None, False),
        ([permissions.IsAuthenticatedOrReadOnly], None, False),
        ([permissions.DjangoModelPermissions], None, False),
        ([permissions.DjangoModelPermissionsOrAnonReadOnly], None, True),
        ([permissions.IsAuthenticated | permissions.AllowAny], None, True),
        ([permissions.IsAuthenticated & permissions.AllowAny], None, False),
        ([permissions.IsAuthenticated | permissions.IsAdminUser], None, False),
    ],
)
def test_which_views_the_schema_says_let_anonymous_requests_in(
    permission_classes: list[Any], authentication_classes: list[Any] | None, admitted: bool
) -> None:
    view = views.APIView()
    view.permission_classes = permission_classes
    if authentication_classes is not None:
        view.authentication_classes = authentication_classes

    assert admits_anonymous(view, "POST") is admitted


def test_the_schema_shows_no_header_without_the_middleware(no_middleware: None) -> None:
    paths = schema()["paths"]
    assert key_header(paths["/api/payments"]["post"]) is None
    assert key_header(paths["/api/own/decorator"]["post"]) is not None


# -- manage.py idempotency_routes ----------------------------------------------------------


def routes(*arguments: str) -> str:
    out = StringIO()
    call_command("idempotency_routes", *arguments, stdout=out)
    return out.getvalue()


def section(text: str, route: str) -> list[str]:
    """The lines under ``route``'s heading."""
    blocks = text.split("\n\n")
    (block,) = [block for block in blocks if block.split("  (")[0] == route]
    return [line.strip() for line in block.splitlines()[1:]]


def test_the_command_says_what_protects_each_route_and_why_not(middleware: None) -> None:
    text = routes()

    assert text.splitlines()[:3] == [
        "IdempotencyMiddleware: installed; MIDDLEWARE_KEYS = 'report': a request without a key "
        "runs unprotected, counted and logged",
        "Plain Django views protected under: /plain-api/",
        "Anonymous requests: left alone by the middleware (IDEMPOTENCY['TENANT'] is not set: "
        "every anonymous client would share one key space)",
    ]
    assert (
        text.split("\n\n")[1].splitlines()[0]
        == "admin/  (django.contrib.admin.sites.AdminSite.index)"
    )
    assert section(text, "api/payments") == [
        "POST                    protected by the middleware, operation POST api/payments",
        "PUT                     protected by the middleware, operation PUT api/payments",
        "DELETE                  protected by the middleware, operation DELETE api/payments",
    ]
    assert section(text, "api/exempt/class") == [
        "POST PUT DELETE         not protected: idempotent_exempt"
    ]
    assert section(text, "api/token") == [
        "POST                    not protected: issues credentials (ObtainAuthToken)"
    ]
    assert section(text, "api/own/decorator") == [
        "POST                    protected by @idempotent, operation own-decorator-payment; ttl=60s"
    ]
    assert section(text, "api/own/mixin")[0] == (
        "POST                    protected by IdempotentMixin, operation own-mixin-payment"
    )
    assert section(text, "admin/login/") == [
        "POST PUT PATCH DELETE   not protected: plain Django view outside "
        "MIDDLEWARE_PLAIN_VIEW_PREFIXES"
    ]
    assert section(text, "plain-api/class-charges") == [
        "POST                    protected by the middleware, operation POST "
        "plain-api/class-charges"
    ]
    assert section(text, "idempotency/status/") == [
        "-                       no unsafe method (GET, HEAD and OPTIONS are never protected)"
    ]


def test_the_command_says_when_a_prefix_covers_part_of_a_routes_paths(settings: Any) -> None:
    configure(settings, MIDDLEWARE_PLAIN_VIEW_PREFIXES=["/plain-api/v1/"])
    text = routes()

    assert section(text, "plain-api/<str:version>/charges")[0] == (
        "POST                    protected by the middleware, operation POST "
        "plain-api/<str:version>/charges (where the path is under MIDDLEWARE_PLAIN_VIEW_PREFIXES)"
    )
    assert section(text, "plain-api/charges")[0].endswith(
        "not protected: plain Django view outside MIDDLEWARE_PLAIN_VIEW_PREFIXES"
    )


def test_the_command_without_the_middleware_says_so(no_middleware: None) -> None:
    text = routes()

    assert text.splitlines()[0].startswith("IdempotencyMiddleware: not in MIDDLEWARE")
    assert section(text, "api/payments") == [
        "POST PUT DELETE         not protected: IdempotencyMiddleware is not in MIDDLEWARE"
    ]


def test_the_command_escapes_what_a_terminal_would_act_on(settings: Any) -> None:
    configure(settings, MIDDLEWARE_PLAIN_VIEW_PREFIXES=["/plain-api/\x1b[2J"])
    assert "Plain Django views protected under: /plain-api/\\x1b[2J" in routes()


def test_the_command_in_json(settings: Any) -> None:
    configure(settings, MIDDLEWARE_KEYS="required", TENANT="tests.testapp.views._tenant")
    listed = json.loads(routes("--format", "json"))

    assert listed["middleware"] == {
        "installed": True,
        "keys": "required",
        "plain_view_prefixes": ["/plain-api/"],
        "anonymous_protected": True,
    }
    by_route = {route["route"]: route for route in listed["routes"]}
    assert by_route["api/payments"]["framework"] == "drf"
    assert by_route["api/payments"]["methods"][0] == {
        "method": "POST",
        "protected": True,
        "by": "middleware",
        "operation": "POST api/payments",
        "options": {"required": True},
        "partial": False,
    }
    assert by_route["api/exempt/route"]["methods"][0] == {
        "method": "POST",
        "protected": False,
        "reason": "idempotent_exempt",
    }
    assert by_route["forms/charges"]["framework"] == "django"
