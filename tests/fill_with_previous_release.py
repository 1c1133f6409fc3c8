"""Fill a database the way the previous release does, with the previous release's code.

Run by tests/test_upgrade_from_previous_release.py, in a subprocess whose
``sys.path`` starts with an extract (``git archive``) of the previous
release: its ``django_idempotency``, its test settings and its test app.
This file is written against THAT release's code, which never changes, so
it may use the helpers and internals that release had (its private
``_store`` and ``_protection`` packages); do not type-check it against this
checkout. When ``PREVIOUS_RELEASE`` moves to a newer release, adapt the
imports here to that release's layout (docs/upgrading.md).

It migrates the app's table into a database with the previous release's
migrations, drives the previous release for real
(requests through its protected views with Django's test client, its
Celery task decorator, and, where only a dead worker leaves a record, the
same store calls that worker made), and prints, as JSON, every response it
got and every record it left.

    python fill_with_previous_release.py '<plan as JSON>'

The plan: ``database`` (Django's settings dict of the database to fill),
``secret_key`` and ``secret_key_fallbacks`` (the new code's, so that keyed
digests match), ``encryption_key`` (a Fernet key for the sealed records).
"""
# mypy: ignore-errors

from __future__ import annotations

import base64
import json
import os
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def configure(plan: dict[str, Any]) -> None:
    """The previous release's test settings, on the given database and secrets."""
    os.environ["DJANGO_SETTINGS_MODULE"] = "tests.settings"
    import tests.settings as settings_module

    settings_module.DATABASES = {"default": plan["database"]}
    settings_module.SECRET_KEY = plan["secret_key"]
    settings_module.SECRET_KEY_FALLBACKS = plan["secret_key_fallbacks"]
    import django

    django.setup()
    import django_idempotency

    # The whole point: this process runs the previous release, not the checkout.
    for module in (django_idempotency, settings_module):
        assert Path(module.__file__).resolve().is_relative_to(HERE), module.__file__


def main() -> None:
    plan = json.loads(sys.argv[1])
    configure(plan)
    from django.core.management import call_command

    call_command("migrate", "django_idempotency", verbosity=0)
    print(json.dumps(fill(plan["encryption_key"])))


def fill(encryption_key: str) -> dict[str, Any]:
    from django.test import override_settings
    from rest_framework.test import APIClient

    from django_idempotency import _store as store
    from django_idempotency import signals, testing
    from django_idempotency.context import IdempotencyContext
    from django_idempotency.models import IdempotencyRecord
    from django_idempotency.scope import Scope

    client = APIClient()
    responses: dict[str, Any] = {}
    crash_at_claim: set[str] = set()

    def die_after_claiming(sender: Any, request: Any, **kwargs: Any) -> None:
        # The worker dies right after its claim committed: SimulatedCrash is
        # a BaseException, which the release lets through without cleanup.
        if request.headers.get("Idempotency-Key") in crash_at_claim:
            raise testing.SimulatedCrash(kwargs["scope"])

    signals.request_claimed.connect(die_after_claiming, weak=False)

    def idempotency(*, sealed: bool = False, **values: Any) -> Any:
        if sealed:
            values["ENCRYPTION_KEYS"] = [encryption_key]
        return override_settings(IDEMPOTENCY=values)

    def send(name: str, url: str, body: dict[str, Any], **conf: Any) -> None:
        key = f"upgrade-{name}"
        with idempotency(**conf):
            try:
                response = client.post(url, body, format="json", HTTP_IDEMPOTENCY_KEY=key)
            except testing.SimulatedCrash:
                response = None
            except Exception as exc:  # the test app's ViewFailure: the view raised
                assert type(exc).__name__ == "ViewFailure", exc
                response = None
        responses[name] = {"url": url, "body": body, "key": key}
        if response is not None:
            responses[name].update(
                status=response.status_code,
                content=base64.b64encode(response.content).decode(),
                headers=dict(response.items()),
            )

    def dead_owner(name: str, url: str, body: dict[str, Any], **conf: Any) -> IdempotencyRecord:
        crash_at_claim.add(f"upgrade-{name}")
        send(name, url, body, **conf)
        return IdempotencyRecord.objects.get(key=f"upgrade-{name}")

    def intent(record: IdempotencyRecord, provider_operation_id: str, **conf: Any) -> None:
        """What the dead owner had committed before dying mid-call: its intent and the id."""
        scope = Scope(record.tenant, record.operation, record.key)
        held = store.Claim(record.pk, record.fencing_token, scope, "default")
        with idempotency(**conf):
            context = IdempotencyContext(held)
            context.begin_external()
            context.set_provider_operation(provider_operation_id)

    # Resolved records, replayed and refused by the new code; every kind of view.
    send("completed", "/api-view/charges", {"amount": 5})
    send("completed_sealed", "/api-view/charges", {"amount": 7}, sealed=True)
    send("failed", "/api-view/charges", {"amount": 3, "status": 402})
    send("failed_sealed", "/api-view/charges", {"amount": 4, "status": 400}, sealed=True)
    send("completed_cbv", "/cbv/charges", {"amount": 8})
    send("completed_mixin", "/mixin/charges", {"amount": 9}, sealed=True)
    send("completed_viewset", "/viewset/charges/", {"amount": 10})
    refunded = json.loads(base64.b64decode(responses["completed_viewset"]["content"]))["id"]
    send("completed_action", f"/viewset/charges/{refunded}/refund/", {})
    send("completed_plain_view", "/plain/charges", {"amount": 11})
    send("completed_selected_fields", "/api-view/fields", {"amount": 12, "card": {"last4": "42"}})
    # Past retention by the time the new code purges.
    send("expiring_completed", "/api-view/charges", {"amount": 13}, TTL=1)
    send("expiring_failed", "/api-view/charges", {"amount": 14, "status": 400}, TTL=1, sealed=True)

    # Owners that are gone: their leases are ended below.
    send("uncertain", "/api-view/external", {"amount": 1, "then": "raise", "provider_id": "op-u"})
    send("uncertain_expiring", "/api-view/external", {"amount": 2, "then": "raise"}, TTL=1)
    dead_owner("claimed_stale", "/api-view/charges", {"amount": 21})
    dead_owner("claimed_stale_recovered", "/api-view/charges", {"amount": 22})
    intent(dead_owner("in_progress_stale", "/api-view/external", {"amount": 3}), "op-ip")
    tasks = fill_tasks(idempotency)
    testing.expire_leases()

    # Owners that hold their lease for an hour yet: the new code answers 409.
    hour = {"LEASE": 3600}
    dead_owner("claimed_live", "/api-view/charges", {"amount": 31}, **hour)
    intent(
        dead_owner("in_progress_live", "/api-view/external", {"amount": 4}, **hour),
        "op-live",
        **hour,
    )

    return {"responses": responses, "tasks": tasks, "records": records()}


def fill_tasks(idempotency: Any) -> dict[str, Any]:
    """Records of ``idempotent_task``: two completed, one whose worker died holding it."""
    from django_idempotency import _store as store
    from django_idempotency._protection.task import TASK_TENANT, _arguments
    from django_idempotency.conf import idempotency_settings
    from django_idempotency.fingerprint import fingerprint
    from django_idempotency.scope import Scope
    from django_idempotency.tasks import idempotent_task

    @idempotent_task(key="event_id", operation="upgrade ship order")
    def ship_order(event_id: str, amount: int) -> dict[str, Any]:
        return {"shipped": event_id, "amount": amount}

    results = {"task_completed": ship_order("evt-1", 5)}
    with idempotency(sealed=True):
        results["task_completed_sealed"] = ship_order("evt-2", 6)
    # The claim a worker commits before running the body, then dies.
    scope = Scope(TASK_TENANT, "upgrade ship order", "evt-3")
    digest = fingerprint(_arguments(ship_order.__wrapped__, ("evt-3", 7), {}))
    conf = idempotency_settings
    assert store.claim(scope, digest, ttl=conf.TTL, lease=conf.LEASE, using="default")
    return results


def records() -> list[dict[str, Any]]:
    from django_idempotency.models import IdempotencyRecord

    rows = []
    for record in IdempotencyRecord.objects.order_by("pk"):
        row = {}
        for field in record._meta.concrete_fields:
            value = getattr(record, field.attname)
            if isinstance(value, bytes | memoryview):
                value = base64.b64encode(bytes(value)).decode()
            elif hasattr(value, "isoformat"):
                value = value.isoformat()
            row[field.attname] = value
        rows.append(row)
    return rows


if __name__ == "__main__":
    main()
