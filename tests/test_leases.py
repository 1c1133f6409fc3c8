"""An owner's write never moves its lease backwards.

A view asks ``begin_external(lease=...)`` for as long as its provider call
may take. Its later writes (the provider's id, a renewal) extend the lease
to at least now + ``LEASE``, and never shorten the longer one: recovery
would take over, and ask the provider about, a call still under way.
"""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from django.test import override_settings
from django.utils import timezone

from django_idempotency import _store as store
from django_idempotency.context import IdempotencyContext
from django_idempotency.fingerprint import fingerprint
from django_idempotency.models import IdempotencyRecord
from django_idempotency.scope import Scope

pytestmark = pytest.mark.django_db(transaction=True)
LONG = timedelta(seconds=600)
LEASE = timedelta(seconds=120)


@pytest.fixture
def context() -> IdempotencyContext:
    held = store.claim(
        Scope("tenant", "POST op", "k"),
        fingerprint({}),
        ttl=timedelta(hours=1),
        lease=LEASE,
        using="default",
    )
    assert held is not None
    return IdempotencyContext(held)


def lease_of(context: IdempotencyContext) -> datetime:
    expires = IdempotencyRecord.objects.get(key=context.key).lease_expires_at
    assert expires is not None
    return expires


@override_settings(IDEMPOTENCY={"LEASE": LEASE})
def test_set_provider_operation_keeps_the_longer_lease_begin_external_asked_for(
    context: IdempotencyContext,
) -> None:
    context.begin_external(lease=LONG)
    asked = lease_of(context)

    context.set_provider_operation("ch_1")

    assert lease_of(context) >= asked
    assert asked > timezone.now() + LONG - timedelta(seconds=30)


@override_settings(IDEMPOTENCY={"LEASE": LEASE})
def test_renew_lease_keeps_the_longer_lease_begin_external_asked_for(
    context: IdempotencyContext,
) -> None:
    context.begin_external(lease=LONG)
    asked = lease_of(context)

    context.renew_lease()

    assert lease_of(context) >= asked


@override_settings(IDEMPOTENCY={"LEASE": LEASE})
def test_a_second_begin_external_with_a_shorter_lease_keeps_the_longer_one(
    context: IdempotencyContext,
) -> None:
    context.begin_external(lease=LONG)
    asked = lease_of(context)

    context.begin_external(lease=timedelta(seconds=5))

    assert lease_of(context) >= asked


@override_settings(IDEMPOTENCY={"LEASE": LEASE})
def test_renew_lease_still_extends_a_shorter_lease(context: IdempotencyContext) -> None:
    context.begin_external(lease=timedelta(seconds=5))
    before = timezone.now()

    context.renew_lease()

    assert lease_of(context) >= before + LEASE


@override_settings(IDEMPOTENCY={"LEASE": LEASE})
def test_set_provider_operation_still_extends_a_shorter_lease(
    context: IdempotencyContext,
) -> None:
    context.begin_external(lease=timedelta(seconds=5))
    before = timezone.now()

    context.set_provider_operation("ch_1")

    assert lease_of(context) >= before + LEASE


def test_a_lease_that_ran_out_is_renewed_from_now(context: IdempotencyContext) -> None:
    IdempotencyRecord.objects.filter(key=context.key).update(
        lease_expires_at=timezone.now() - timedelta(hours=1)
    )
    before = timezone.now()

    store.renew_lease(context._held, lease=LEASE)

    assert lease_of(context) >= before + LEASE


def test_mark_uncertain_still_ends_the_lease_now(context: IdempotencyContext) -> None:
    context.begin_external(lease=LONG)

    store.mark_uncertain(context._held, provider_key="p", provider_operation_id="")

    assert lease_of(context) <= timezone.now()


def test_a_lease_owner_names_its_host_process_and_thread_even_after_a_fork() -> None:
    """What recovery and the admin show: each thread its own, a forked child its own pid."""
    import os
    import socket
    import threading

    here = store.lease_owner()
    others: list[str] = []
    thread = threading.Thread(target=lambda: others.append(store.lease_owner()))
    thread.start()
    thread.join()
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:  # the child: its owner, through the pipe, and out without cleanup
        os.write(writer, store.lease_owner().encode())
        os._exit(0)
    os.close(writer)
    os.waitpid(child, 0)
    with os.fdopen(reader, "rb") as pipe:
        in_child = pipe.read().decode()

    assert here == f"{socket.gethostname()}:{os.getpid()}:{threading.get_ident()}"
    assert store.lease_owner() == here
    assert others == [f"{socket.gethostname()}:{os.getpid()}:{thread.ident}"]
    assert in_child == f"{socket.gethostname()}:{child}:{threading.get_ident()}"
