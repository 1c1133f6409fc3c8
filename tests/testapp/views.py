"""One protected view of every kind the decorator supports.

The request body steers the view, so the tests can reach every row of the
HTTP behaviour table: ``status`` (answer with it after writing), ``raise``
(write, then raise), ``invalid`` (raise DRF's ValidationError), ``forbidden``
(raise DRF's PermissionDenied, a definitive 403), ``sleep``
(seconds to hold the claim, for the race tests), ``lose_store`` (write,
then have PostgreSQL terminate this request's session, as an outage would;
``"refuse"``: and refuse new connections to the database until a test
allows them again); ``swallow_integrity_error`` (after writing, fail an
INSERT and catch the IntegrityError without a savepoint, a common habit);
``db_error`` (after writing, have the database raise a real "deadlock",
"serialization" failure or "statement_timeout"; ``db_error_once``: only on
the first request with this Idempotency-Key, as a transient one would).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from django.db import IntegrityError, connection, transaction
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from rest_framework import generics, serializers, status, viewsets
from rest_framework.decorators import action, api_view
from rest_framework.exceptions import APIException, PermissionDenied, ValidationError
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from django_idempotency import idempotent
from django_idempotency.drf import IdempotentMixin
from django_idempotency.models import IdempotencyRecord
from tests.testapp.models import Charge
from tests.utils import data_of, idempotency_of


class ViewFailure(RuntimeError):
    pass


class StatusRaised(APIException):
    """A DRF exception of any status (DRF has no class for 423 Locked, say)."""

    def __init__(self, status_code: int) -> None:
        super().__init__(f"Answered {status_code}.")
        self.status_code = status_code


def _tenant(request: Any) -> str:
    user = getattr(request, "user", None)
    return f"user:{user.pk}" if user is not None and user.is_authenticated else "anonymous"


def perform(request: Any, data: Any) -> tuple[Charge, int]:
    """The side effect, steered by the body."""
    if data.get("sleep"):
        time.sleep(float(data["sleep"]))
    if data.get("invalid"):
        raise ValidationError({"amount": ["This amount is not accepted."]})
    if data.get("forbidden"):
        raise PermissionDenied("This charge is not allowed.")
    if data.get("raise_status"):
        raise StatusRaised(int(data["raise_status"]))
    charge = Charge.objects.create(
        tenant=_tenant(request), amount=int(data.get("amount", 0)), note=str(data.get("note", ""))
    )
    if data.get("raise"):
        raise ViewFailure("the view failed after writing")
    if data.get("swallow_integrity_error"):
        try:  # noqa: SIM105 (the habit, written as people write it)
            Charge.objects.create(pk=charge.pk, tenant="duplicate", amount=0)
        except IntegrityError:
            pass  # the habit: no savepoint, so the transaction is doomed
    if data.get("db_error") and _first_time(request, data):
        raise_database_error(str(data["db_error"]))
    if data.get("lose_store"):
        _terminate_this_session(refuse_new=data["lose_store"] == "refuse")
    return charge, int(data.get("status", status.HTTP_201_CREATED))


_failed_once: set[str] = set()


def _first_time(request: Any, data: Any) -> bool:
    if not data.get("db_error_once"):
        return True
    key = request.headers.get("Idempotency-Key", "")
    if key in _failed_once:
        return False
    _failed_once.add(key)
    return True


def raise_database_error(kind: str) -> None:
    """Have the database server raise a real error of this kind on this connection."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            if kind == "statement_timeout":
                cursor.execute("SET LOCAL statement_timeout = 50")
                cursor.execute("SELECT pg_sleep(2)")
            sqlstate = {"deadlock": "40P01", "serialization": "40001"}[kind]
            cursor.execute(
                f"DO $$ BEGIN RAISE EXCEPTION '{kind}' USING ERRCODE = '{sqlstate}'; END $$"
            )
        elif connection.vendor == "mysql":
            if kind == "statement_timeout":
                cursor.execute("SET STATEMENT max_statement_time=0.05 FOR SELECT SLEEP(2)")
            errno = {"deadlock": 1213, "serialization": 1020}[kind]
            cursor.execute(f"SIGNAL SQLSTATE '40001' SET MYSQL_ERRNO = {errno}")
        else:
            raise NotImplementedError(f"no {kind} on {connection.vendor}")


def _terminate_this_session(*, refuse_new: bool) -> None:
    """Have the server end this connection's session, from another connection."""
    import psycopg
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        pid = cursor.fetchone()[0]
    where = connection.settings_dict
    with psycopg.connect(
        host=where["HOST"],
        port=where["PORT"] or 5432,
        user=where["USER"],
        password=where["PASSWORD"],
        dbname="postgres",  # the server's maintenance database
        autocommit=True,
    ) as other:
        if refuse_new:
            other.execute(f'ALTER DATABASE "{where["NAME"]}" ALLOW_CONNECTIONS false')
        other.execute("SELECT pg_terminate_backend(%s)", [pid])


def charge_response(charge: Charge, code: int, **extra_headers: str) -> Response:
    return Response(
        {"id": charge.pk, "amount": charge.amount, "tenant": charge.tenant},
        status=code,
        headers={"Location": f"/charges/{charge.pk}", **extra_headers},
    )


@api_view(["GET", "POST"])
@idempotent
def api_view_charges(request: Request) -> Response:
    if request.method == "GET":
        return Response({"count": Charge.objects.count()})
    charge, code = perform(request, request.data)
    return charge_response(charge, code, ETag=f'"{charge.pk}"')


@api_view(["POST"])
@idempotent(fingerprint=["amount", "card.last4"], ttl=60, operation="charge-by-fields")
def api_view_selected_fields(request: Request) -> Response:
    charge, code = perform(request, request.data)
    return charge_response(charge, code)


@api_view(["POST"])
@idempotent(required=False)
def api_view_optional_key(request: Request) -> Response:
    charge, code = perform(request, request.data)
    return charge_response(charge, code)


class ChargeAPIView(APIView):
    @idempotent
    def post(self, request: Request) -> Response:
        charge, code = perform(request, request.data)
        return charge_response(charge, code)


class ChargeDetailAPIView(APIView):
    @idempotent
    def put(self, request: Request, pk: int) -> Response:
        charge = Charge.objects.get(pk=pk)
        charge.amount = int(data_of(request)["amount"])
        charge.save()
        return charge_response(charge, status.HTTP_200_OK)

    @idempotent
    def delete(self, request: Request, pk: int) -> Response:
        Charge.objects.filter(pk=pk).delete()
        return Response(status=status.HTTP_204_NO_CONTENT)


class ChargeSerializer(serializers.ModelSerializer[Charge]):
    class Meta:
        model = Charge
        fields = ["id", "tenant", "amount", "note", "refunded"]
        read_only_fields = ["id", "tenant", "refunded"]


class ChargeGenericView(generics.CreateAPIView[Charge]):
    serializer_class = ChargeSerializer

    def perform_create(self, serializer: serializers.BaseSerializer[Charge]) -> None:
        serializer.save(tenant=_tenant(self.request))

    @idempotent
    def post(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return super().post(request, *args, **kwargs)


class ChargeViewSet(viewsets.ModelViewSet[Charge]):
    serializer_class = ChargeSerializer
    queryset = Charge.objects.all()

    def perform_create(self, serializer: serializers.BaseSerializer[Charge]) -> None:
        serializer.save(tenant=_tenant(self.request))

    @idempotent
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return super().create(request, *args, **kwargs)

    @idempotent
    def update(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return super().update(request, *args, **kwargs)

    @idempotent
    def destroy(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return super().destroy(request, *args, **kwargs)

    @action(detail=True, methods=["post"])
    @idempotent
    def refund(self, request: Request, pk: str | None = None) -> Response:
        charge = self.get_object()
        charge.refunded = True
        charge.save(update_fields=["refunded"])
        return Response({"id": charge.pk, "refunded": True}, status=status.HTTP_201_CREATED)


class MixinChargeView(IdempotentMixin, generics.ListCreateAPIView[Charge]):
    serializer_class = ChargeSerializer
    queryset = Charge.objects.all()

    def perform_create(self, serializer: serializers.BaseSerializer[Charge]) -> None:
        serializer.save(tenant=_tenant(self.request))


@idempotent
def plain_django_charges(request: HttpRequest) -> JsonResponse:
    data = json.loads(request.body or b"{}")
    charge, code = perform(request, data)
    return JsonResponse({"id": charge.pk, "amount": charge.amount}, status=code)


def committed_claims() -> int:
    """Claimed records visible from a second connection, i.e. committed ones."""
    from django.db import connections

    other = connections.create_connection("default")
    try:
        with other.cursor() as cursor:
            cursor.execute(
                "SELECT COUNT(*) FROM django_idempotency_record WHERE state = %s", ["CLAIMED"]
            )
            return int(cursor.fetchone()[0])
    finally:
        other.close()


class TransactionProbeView(APIView):
    """Reports the transaction the handler runs in; ``post`` is protected, ``put`` not."""

    def probe(self, request: Request) -> Response:
        from django.db import connection

        Charge.objects.create(tenant="probe", amount=int(data_of(request).get("amount", 0)))
        return Response(
            {
                "in_atomic_block": connection.in_atomic_block,
                "committed_claims": committed_claims(),
            },
            status=int(data_of(request).get("status", 201)),
        )

    @idempotent
    def post(self, request: Request) -> Response:
        return self.probe(request)

    def put(self, request: Request) -> Response:
        return self.probe(request)


class DurableBlockView(APIView):
    """Opens ``transaction.atomic(durable=True)``, as code written for unprotected views may."""

    def charge(self, request: Request) -> Response:
        with transaction.atomic(durable=True):
            Charge.objects.create(tenant="durable", amount=int(data_of(request)["amount"]))
        return Response(status=status.HTTP_201_CREATED)

    @idempotent
    def post(self, request: Request) -> Response:
        return self.charge(request)

    @idempotent(optimistic=True)
    def put(self, request: Request) -> Response:
        return self.charge(request)

    @idempotent
    def patch(self, request: Request) -> Response:
        """A RuntimeError of the view's own, with a cause of its own."""
        try:
            int("not a number")
        except ValueError as exc:
            raise RuntimeError("the view's own failure") from exc
        return Response(status=status.HTTP_200_OK)


@api_view(["POST"])
@idempotent
def api_view_probe(request: Request) -> Response:
    return TransactionProbeView().probe(request)


@transaction.non_atomic_requests
@api_view(["POST"])
@idempotent
def api_view_probe_exempt(request: Request) -> Response:
    return TransactionProbeView().probe(request)


class MixinSelectedInputView(IdempotentMixin, generics.CreateAPIView[Charge]):
    """Mixin options as class attributes, a callable among them."""

    serializer_class = ChargeSerializer
    idempotency_fingerprint = lambda request: {"amount": data_of(request).get("amount")}  # noqa: E731
    idempotency_operation = "mixin-selected"

    def perform_create(self, serializer: serializers.BaseSerializer[Charge]) -> None:
        serializer.save(tenant=_tenant(self.request))


@api_view(["POST"])
@idempotent
def api_view_charge_for_reference(request: Request, ref: uuid.UUID) -> Response:
    charge, code = perform(request, {**data_of(request), "note": str(ref)})
    return charge_response(charge, code)


class OwnDispatchView(ChargeAPIView):
    """Overrides dispatch, so the exemption on the base class's dispatch is lost."""

    def dispatch(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        return super().dispatch(request, *args, **kwargs)


def committed_state() -> str | None:
    """The record's state as another connection sees it: what is committed."""
    from django.db import connections

    other = connections.create_connection("default")
    try:
        with other.cursor() as cursor:
            cursor.execute("SELECT state, provider_key FROM django_idempotency_record")
            row = cursor.fetchone()
            return None if row is None else f"{row[0]} {row[1]}"
    finally:
        other.close()


@api_view(["POST"])
@idempotent
def api_view_external_call(request: Request) -> Response:
    """An external call between local writes, steered by the body.

    ``then``: "raise" or a status to answer with after the call;
    ``provider_id``: the id the "provider" gave back; ``hold``: seconds to
    wait between the local write (the transaction holds its connection) and
    ``begin_external()``; ``peek``: false to skip reading the record on
    another connection after ``begin_external()``.
    """
    data = data_of(request)
    Charge.objects.create(tenant="before-call", amount=int(data.get("amount", 0)))
    if data.get("hold"):
        time.sleep(float(data["hold"]))
    if data.get("read_first"):  # the transaction's snapshot starts here
        IdempotencyRecord.objects.filter(key=idempotency_of(request).key).exists()
    provider_key = idempotency_of(request).begin_external()
    # On a connection of its own (``"peek": false`` skips it: behind a small
    # pool that connection would wait for the one this transaction holds).
    seen_after_begin = committed_state() if data.get("peek", True) else None
    if data.get("lose_store"):
        _terminate_this_session(refuse_new=False)
    if data.get("provider_id"):
        idempotency_of(request).set_provider_operation(data["provider_id"])
    then = data.get("then")
    if then == "raise":
        raise ViewFailure("the provider connection dropped")
    return Response(
        {"provider_key": provider_key, "committed_after_begin": seen_after_begin},
        status=int(then or 201),
    )


class Provider:
    """A payment provider in this process: one charge per idempotency key.

    Tests replace ``provider`` with a double of their own (one that "dies"
    mid-call, say), as a project's tests replace its provider client.
    """

    def __init__(self) -> None:
        self.charges: dict[str, str] = {}

    def charge(self, amount: int, idempotency_key: str) -> str:
        return self.charges.setdefault(idempotency_key, f"ch_{len(self.charges) + 1}")


provider = Provider()


@api_view(["POST"])
@idempotent
def api_view_provider_charge(request: Request) -> Response:
    """A charge through ``provider``, as the docs write it: intent, call, then the call's id."""
    amount = int(data_of(request).get("amount", 0))
    Charge.objects.create(tenant="provider", amount=amount)
    claim = idempotency_of(request)
    charge_id = provider.charge(amount, idempotency_key=claim.begin_external())
    claim.set_provider_operation(charge_id)
    return Response({"charge": charge_id}, status=201)


@api_view(["POST"])
@idempotent
def api_view_steps(request: Request) -> Response:
    """Several external calls (steps), steered by the body.

    ``steps``: ``[{"name": ..., "provider_id": ...}, ...]``, begun in that
    order (``provider_id`` absent: the "provider" gave none back before
    ``then``); a step already known with a provider id (an earlier
    attempt's, kept by ``RetryFrom``) is skipped, not begun again.
    ``then``: "raise" or a status to answer with after the steps. Both may
    come in the ``X-Steps`` header instead (JSON), which is not part of the
    fingerprint: a retry of the same input that behaves differently.
    """
    data = {**data_of(request), **json.loads(request.headers.get("X-Steps", "{}"))}
    context = idempotency_of(request)
    Charge.objects.create(tenant="steps", amount=int(data.get("amount", 0)))
    keys, skipped = {}, []
    for step in data.get("steps", []):
        known = context.step(step["name"])
        if known is not None and known.provider_operation_id:
            skipped.append(step["name"])
            keys[step["name"]] = known.provider_key
            continue
        keys[step["name"]] = context.begin_external(step=step["name"])
        if step.get("provider_id"):
            context.set_provider_operation(step["provider_id"], step=step["name"])
    then = data.get("then")
    if then == "raise":
        raise ViewFailure("the provider connection dropped between the steps")
    return Response(
        {
            "keys": keys,
            "skipped": skipped,
            "known": {step.name: step.provider_operation_id for step in context.steps},
        },
        status=int(then or 201),
    )


@api_view(["POST"])
def api_view_unprotected(request: Request) -> Response:
    charge, code = perform(request, request.data)
    return charge_response(charge, code)


@csrf_exempt  # an API endpoint: clients send no CSRF token
@idempotent
async def async_plain_charges(request: HttpRequest) -> JsonResponse:
    data = json.loads(request.body or b"{}")
    if data.get("sleep"):
        import asyncio

        await asyncio.sleep(float(data["sleep"]))
    charge = await Charge.objects.acreate(
        tenant="async", amount=int(data.get("amount", 0)), note=str(data.get("note", ""))
    )
    if data.get("raise"):
        raise ViewFailure("the async view failed after writing")
    return JsonResponse(
        {"id": charge.pk, "amount": charge.amount}, status=int(data.get("status", 201))
    )


@idempotent
def plain_form_charges(request: HttpRequest) -> JsonResponse:
    """A plain Django form view, CSRF-protected (not exempt): reads ``request.POST``.

    Behind ``CsrfViewMiddleware`` the form is parsed before the view, and
    before the fingerprint, runs.
    """
    charge, code = perform(request, request.POST)
    files = sorted(
        upload.name or "" for field in request.FILES for upload in request.FILES.getlist(field)
    )
    return JsonResponse({"id": charge.pk, "amount": charge.amount, "files": files}, status=code)
