"""``request.idempotency``: what a protected view knows about its claim."""

from __future__ import annotations

import json
from datetime import timedelta

from asgiref.sync import sync_to_async
from django.core.exceptions import ImproperlyConfigured

from django_idempotency import digests, store
from django_idempotency.conf import as_timedelta, idempotency_settings
from django_idempotency.exceptions import IsolationNotSupported
from django_idempotency.scope import Scope
from django_idempotency.simulated_crash import SimulatedCrash, crash_requested
from django_idempotency.store.connections import snapshot_isolated

__all__ = [
    "IdempotencyContext",
    "derive_provider_key",
]


def derive_provider_key(scope: Scope) -> str:
    """A key for the downstream provider, derived only from the scoped key.

    Deterministic, so a restarted process, a retry after a released claim,
    or a reconciler derives the same one, and the provider deduplicates
    every attempt at the operation, even one that outlived its lease. The
    price: a client key reused after ``expires_at`` (a new operation for us)
    reaches the provider under the old provider key, which answers with the
    old operation's result; a view should check that the provider's answer
    belongs to the request (the demo compares the order id). A keyed digest
    (``digests.provider_key``) of at most 64 characters, so it fits any
    provider's key limits and reveals nothing of the tenant or the client's
    key, even to someone who can guess them.

    Deterministic only under one secret: once ``begin_external()`` wrote it
    to the record, it is read from there (a takeover, a reconciler), never
    derived again.
    """
    material = json.dumps([scope.tenant, scope.operation, scope.key])
    return digests.provider_key(material.encode("ascii"))


class IdempotencyContext:
    """The claim a protected view runs under, and its owner's writes.

    ``request.idempotency`` inside a protected view that won the claim.
    Around a call to an external provider (a payment, an email):

    ```python
    provider_key = request.idempotency.begin_external()
    charge = provider.charge(amount, idempotency_key=provider_key)
    request.idempotency.set_provider_operation(charge.id)
    ```

    ``begin_external()`` commits the intent before the call, even though the
    view's own transaction is still open; ``set_provider_operation()``
    commits the provider's id as soon as it is known. If the view then fails
    (raises, or answers 5xx), the record is left UNCERTAIN for a reconciler
    instead of being released: the call may have happened.

    Every write raises ``StaleOwner`` if the record was taken over meanwhile
    (the lease ran out and recovery or a retry took it); the request then
    ends with 409.
    """

    def __init__(self, held: store.Claim, *, single_transaction: bool = False) -> None:
        self._held = held
        self._single_transaction = single_transaction
        self.external_begun = False
        self.provider_operation_id = ""
        self._isolation_checked = False
        # The record's own, if it has one (a claim taken over): never a second.
        self._provider_key = held.provider_key

    @property
    def scope(self) -> Scope:
        """The (tenant, operation, key) triple naming the record."""
        return self._held.scope

    @property
    def key(self) -> str:
        """The client's ``Idempotency-Key``, unquoted."""
        return self._held.scope.key

    @property
    def tenant(self) -> str:
        """The resolved tenant (``IDEMPOTENCY["TENANT"]``), as stored."""
        return self._held.scope.tenant

    @property
    def operation(self) -> str:
        """The operation name: ``operation=``, or the method plus the URL route pattern."""
        return self._held.scope.operation

    @property
    def database(self) -> str:
        """The alias of the database holding the record and the view's transaction.

        ``IDEMPOTENCY["DATABASE"]``, or the routers' choice for this request
        when it is ``None``. Write the view's rows there
        (``Payment.objects.using(request.idempotency.database)``): routers
        never see the tenant, so a write left to them may land elsewhere,
        outside the transaction the outcome commits in.
        """
        return self._held.database

    @property
    def fencing_token(self) -> int:
        """The token every write of this owner is conditional on; a takeover moves it on."""
        return self._held.fencing_token

    @property
    def provider_key(self) -> str:
        """A stable key to give the downstream provider for this operation.

        A keyed, versioned digest (HMAC-SHA256, ``"<version>:<hex>"``, at most
        64 characters) of (tenant, operation, key): the same in any process,
        and revealing nothing of the tenant or the key. Once
        ``begin_external()`` wrote it to the record, the record's own (a
        takeover and a reconciler read it from there).
        """
        if not self._provider_key:
            self._provider_key = derive_provider_key(self._held.scope)
        return self._provider_key

    def begin_external(self, *, lease: timedelta | float | None = None) -> str:
        """Commit IN_PROGRESS and the provider key before an external call.

        The write commits at once, through a second connection, although the
        view's transaction is still open (on SQLite, and inside a transaction
        the caller opened, it joins the view's transaction instead). It also
        renews the lease. A second call writes again and returns the same key.

        Args:
            lease: How long the record stays this request's, in seconds or as
                a ``timedelta``; ``None``: ``IDEMPOTENCY["LEASE"]``. It must
                outlast the external call, timeouts included: once it runs
                out, recovery may take the record over and ask the provider
                while the call is still under way. No later write of this
                request shortens it, a second ``begin_external()`` with a
                shorter lease included.

        Returns:
            The provider key (``provider_key``), to send to the provider as
            its idempotency key.

        Raises:
            ImproperlyConfigured: The view claims with
                ``single_transaction=True``, so the intent cannot commit
                before the call.
            IsolationNotSupported: The records' database runs the view's
                transaction above READ COMMITTED.
            StaleOwner: The record was taken over meanwhile.
        """
        if self._single_transaction:
            raise ImproperlyConfigured(
                "begin_external() cannot be used with single_transaction=True: the claim "
                "commits only with the view, so the intent could not commit before the call."
            )
        self._refuse_snapshot_isolation()
        held_for = as_timedelta(lease) if lease is not None else idempotency_settings.LEASE
        store.begin_external(self._held, self.provider_key, lease=held_for)
        self.external_begun = True
        if crash_requested():
            raise SimulatedCrash(self._held.scope)
        return self.provider_key

    def _refuse_snapshot_isolation(self) -> None:
        """Refuse before the call, not after it: see ``IsolationNotSupported``."""
        held = self._held
        if self._isolation_checked or held.write_now_alias == held.database:
            return  # no second connection: the intent joins the view's transaction
        level = snapshot_isolated(held.database)
        if level is not None:
            raise IsolationNotSupported(
                f"begin_external() needs the view's transaction at READ COMMITTED, but "
                f"it runs at {level.upper()}: the completion would fail with a "
                "serialization error after the external call. Use READ COMMITTED for the "
                "records' database (PostgreSQL's default), or keep the view free of "
                "external calls."
            )
        self._isolation_checked = True

    def set_provider_operation(self, operation_id: str) -> None:
        """Commit the provider's id for the call (a charge id, say).

        Extends the lease to at least now + ``IDEMPOTENCY["LEASE"]``; never
        shortens a longer one asked for with ``begin_external(lease=...)``.

        Args:
            operation_id: The provider's id of the operation, stored as text
                (``provider_operation_id``) for reconcilers and operators.

        Raises:
            StaleOwner: The record was taken over meanwhile.
        """
        self.provider_operation_id = str(operation_id)
        store.set_provider_operation(
            self._held, self.provider_operation_id, lease=idempotency_settings.LEASE
        )

    def renew_lease(self) -> None:
        """Extend the lease to at least now + ``IDEMPOTENCY["LEASE"]``; call it in long views.

        Never shortens a longer lease asked for with ``begin_external(lease=...)``.

        Raises:
            StaleOwner: The record was taken over meanwhile.
        """
        store.renew_lease(self._held, lease=idempotency_settings.LEASE)

    # For ``async def`` views: the same writes, on the request's sync thread
    # (where its transaction and connections live).
    async def abegin_external(self, *, lease: timedelta | float | None = None) -> str:
        """``begin_external()`` for ``async def`` views, on the request's sync thread."""
        return await sync_to_async(self.begin_external, thread_sensitive=True)(lease=lease)

    async def aset_provider_operation(self, operation_id: str) -> None:
        """``set_provider_operation()`` for ``async def`` views, on the request's sync thread."""
        await sync_to_async(self.set_provider_operation, thread_sensitive=True)(operation_id)

    async def arenew_lease(self) -> None:
        """``renew_lease()`` for ``async def`` views, on the request's sync thread."""
        await sync_to_async(self.renew_lease, thread_sensitive=True)()
