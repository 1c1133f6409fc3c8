"""``request.idempotency``: what a protected view knows about its claim."""

from __future__ import annotations

import json
from datetime import timedelta

from asgiref.sync import sync_to_async
from django.core.exceptions import ImproperlyConfigured

from django_idempotency import _store as store
from django_idempotency._observability.tracing import step_span
from django_idempotency._protection.crash import SimulatedCrash, crash_requested
from django_idempotency._store import digests
from django_idempotency._store.connections import snapshot_isolated
from django_idempotency._store.steps import StepWrite, steps_of
from django_idempotency.conf import as_timedelta, idempotency_settings
from django_idempotency.exceptions import IsolationNotSupported
from django_idempotency.models import STEP_NAME_MAX_LENGTH, IdempotencyStep
from django_idempotency.scope import Scope

__all__ = [
    "IdempotencyContext",
    "derive_provider_key",
]


def derive_provider_key(scope: Scope, *, step: str | None = None) -> str:
    """A key for the downstream provider, derived only from the scoped key (and the step).

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

    Args:
        scope: The record's (tenant, operation, key).
        step: ``begin_external(step=...)``'s name: each step of one
            operation gets a key of its own (the step's name is part of the
            digested material), stored on the step's row. ``None``: the
            record's one call, the key of earlier releases.

    Returns:
        ``"<version>:<hex>"``, at most 64 characters.
    """
    parts = [scope.tenant, scope.operation, scope.key]
    if step is not None:
        parts.append(step)
    material = json.dumps(parts)
    return digests.provider_key(material.encode("ascii"))


def _checked_step_name(step: str) -> str:
    # Printable only: PostgreSQL refuses a NUL in text (a DataError in the
    # middle of the view), and control characters garble the admin and logs.
    if (
        not isinstance(step, str)
        or not step
        or len(step) > STEP_NAME_MAX_LENGTH
        or not step.isprintable()
    ):
        raise ValueError(
            f"A step's name is a non-empty string of at most {STEP_NAME_MAX_LENGTH} "
            f"printable characters, not {step!r}."
        )
    return step


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

    Several calls in one operation (authorize, then capture) are named
    steps, each with its intent, its provider key and its provider id:

    ```python
    authorized = request.idempotency.step("authorize")  # an earlier attempt's
    if authorized is not None and authorized.provider_operation_id:
        authorization_id = authorized.provider_operation_id  # never called again
    else:
        key = request.idempotency.begin_external(step="authorize")
        authorization_id = provider.authorize(amount, idempotency_key=key).id
        request.idempotency.set_provider_operation(authorization_id, step="authorize")
    key = request.idempotency.begin_external(step="capture")
    ...
    ```

    Every write raises ``StaleOwner`` if the record was taken over meanwhile
    (the lease ran out and recovery or a retry took it); the request then
    ends with 409.
    """

    def __init__(self, held: store.Claim, *, optimistic: bool = False) -> None:
        self._held = held
        self._optimistic = optimistic
        self.external_begun = False
        self.provider_operation_id = ""
        self._isolation_checked = False
        # The record's own, if it has one (a claim taken over): never a second.
        self._provider_key = held.provider_key
        # Whether begin_external() without a step ran: only then is the
        # record's provider_key column this request's to write.
        self._record_call_begun = False
        # The record's steps as stored (loaded on first use), then as this
        # request wrote them; and those this request began, in order, which
        # ``leave_uncertain()`` writes again after a rollback.
        self._steps: dict[str, IdempotencyStep] | None = None
        self._begun_steps: dict[str, IdempotencyStep] = {}

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
        """The token every write of this owner is conditional on; a takeover moves it on.

        0 under ``optimistic=True``: no record exists while the view runs.
        """
        return self._held.fencing_token

    @property
    def provider_key(self) -> str:
        """A stable key to give the downstream provider for this operation.

        A keyed, versioned digest (HMAC-SHA256, ``"<version>:<hex>"``, at most
        64 characters) of (tenant, operation, key): the same in any process,
        and revealing nothing of the tenant or the key. Once
        ``begin_external()`` wrote it to the record, the record's own (a
        takeover and a reconciler read it from there). A step's key is the
        step's own: ``begin_external(step=...)`` returns it, ``step(name)``
        holds it.
        """
        if not self._provider_key:
            self._provider_key = derive_provider_key(self._held.scope)
        return self._provider_key

    @property
    def steps(self) -> list[IdempotencyStep]:
        """The operation's steps known so far, in the order they were begun.

        Those an earlier attempt stored (kept by a reconciler's
        ``RetryFrom``), then those this request began. Read from the
        database on first use, and only if the record was ever taken over:
        a record this request claimed fresh holds only its own steps.
        """
        return list(self._known_steps().values())

    def step(self, name: str) -> IdempotencyStep | None:
        """The step ``name`` as known so far, or ``None`` if it was never begun.

        A view re-run after a reconciler's ``RetryFrom`` skips a step whose
        ``provider_operation_id`` is known, instead of calling its provider
        again: a provider may have forgotten its own idempotency key by now
        (docs/external-calls.md, "Several calls: steps").

        Args:
            name: The step's name, as given to ``begin_external(step=...)``.

        Returns:
            An unsaved-looking ``IdempotencyStep`` with ``name``,
            ``provider_key`` and ``provider_operation_id`` (``""`` until
            known); ``None`` when no attempt began it.
        """
        return self._known_steps().get(name)

    def _known_steps(self) -> dict[str, IdempotencyStep]:
        if self._steps is None:
            held = self._held
            # Fencing token 1: claimed by this very request and never taken
            # over, so every step of the record is one this request wrote.
            # (A released or purged record took its steps with it.)
            if held.fencing_token <= 1:  # 0: optimistic, no record yet
                self._steps = {}
            else:
                stored = steps_of(held.record_id, using=held.database)
                self._steps = {step.name: step for step in stored}
        return self._steps

    def begin_external(
        self, *, step: str | None = None, lease: timedelta | float | None = None
    ) -> str:
        """Commit IN_PROGRESS and the provider key before an external call.

        The write commits at once, through a second connection, although the
        view's transaction is still open (on SQLite, and inside a transaction
        the caller opened, it joins the view's transaction instead). It also
        renews the lease. A second call writes again and returns the same key.

        Args:
            step: The name of one call of several (``"authorize"``,
                ``"capture"``; at most 64 characters): the step's row is
                committed with the record's state, with a provider key of
                its own, derived from the scoped key and the name, or the
                stored one if an earlier attempt began the step. ``None``:
                the operation's one call, whose key is the record's
                ``provider_key``.
            lease: How long the record stays this request's, in seconds or as
                a ``timedelta``; ``None``: ``IDEMPOTENCY["LEASE"]``. It must
                outlast the external call, timeouts included: once it runs
                out, recovery may take the record over and ask the provider
                while the call is still under way. No later write of this
                request shortens it, a second ``begin_external()`` with a
                shorter lease included.

        Returns:
            The provider key (``provider_key``, or the step's), to send to
            the provider as its idempotency key.

        Raises:
            ImproperlyConfigured: The view runs with ``optimistic=True``,
                where duplicates may each run it.
            IsolationNotSupported: The records' database runs the view's
                transaction above READ COMMITTED.
            ValueError: ``step`` is empty or longer than 64 characters.
            StaleOwner: The record was taken over meanwhile.
        """
        self._refuse_optimistic("begin_external()")
        if step is not None:
            _checked_step_name(step)
        self._refuse_snapshot_isolation()
        held_for = as_timedelta(lease) if lease is not None else idempotency_settings.LEASE
        with step_span("idempotency.begin_external", self._held.scope) as span:
            if step is None:
                provider_key = self.provider_key
                store.begin_external(self._held, provider_key, lease=held_for)
                self._record_call_begun = True
            else:
                span.set_attribute("idempotency.step", step)
                provider_key = self._begin_step(step, held_for)
        self.external_begun = True
        if crash_requested("begin_external", step):
            raise SimulatedCrash(self._held.scope)
        return provider_key

    def _begin_step(self, name: str, lease: timedelta) -> str:
        known = self._known_steps()
        stored = known.get(name)
        # A stored step's key is its own: never derived again (the secret
        # may have been rotated since).
        provider_key = (
            stored.provider_key if stored else derive_provider_key(self._held.scope, step=name)
        )
        store.begin_step(self._held, name, provider_key, stored=stored is not None, lease=lease)
        if stored is None:
            stored = IdempotencyStep(
                record_id=self._held.record_id, name=name, provider_key=provider_key
            )
            known[name] = stored
        self._begun_steps[name] = stored
        return provider_key

    def _refuse_optimistic(self, what: str) -> None:
        if self._optimistic:
            raise ImproperlyConfigured(
                f"{what} cannot be used with optimistic=True: concurrent duplicates may each "
                "run the view, so a call outside the records' database would be made once "
                "per duplicate, and no record exists to hold its intent before the call. "
                "Use the default mode for views that call out."
            )

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

    def set_provider_operation(self, operation_id: str, *, step: str | None = None) -> None:
        """Commit the provider's id for the call (a charge id, say).

        Extends the lease to at least now + ``IDEMPOTENCY["LEASE"]``; never
        shortens a longer one asked for with ``begin_external(lease=...)``.

        Args:
            operation_id: The provider's id of the operation, stored as text
                (``provider_operation_id``) for reconcilers and operators.
            step: The step the call belongs to, begun by this request with
                ``begin_external(step=...)``; ``None``: the record's one call.

        Raises:
            ValueError: This request did not begin ``step``.
            StaleOwner: The record was taken over meanwhile.
            ImproperlyConfigured: The view runs with ``optimistic=True``.
        """
        self._refuse_optimistic("set_provider_operation()")
        if step is None:
            self.provider_operation_id = str(operation_id)
            store.set_provider_operation(
                self._held, self.provider_operation_id, lease=idempotency_settings.LEASE
            )
        else:
            begun = self._begun_steps.get(step)
            if begun is None:
                raise ValueError(
                    f"set_provider_operation(step={step!r}) needs begin_external(step={step!r}) "
                    "first, in this request: the intent commits before the call."
                )
            store.set_step_provider_operation(
                self._held, step, str(operation_id), lease=idempotency_settings.LEASE
            )
            begun.provider_operation_id = str(operation_id)
        if crash_requested("set_provider_operation", step):
            raise SimulatedCrash(self._held.scope)

    def renew_lease(self) -> None:
        """Extend the lease to at least now + ``IDEMPOTENCY["LEASE"]``; call it in long views.

        Never shortens a longer lease asked for with ``begin_external(lease=...)``.

        With ``optimistic=True`` there is no lease: nothing is claimed while
        the view runs, so this does nothing.

        Raises:
            StaleOwner: The record was taken over meanwhile.
        """
        if self._optimistic:
            return
        store.renew_lease(self._held, lease=idempotency_settings.LEASE)

    def leave_uncertain(self, *, with_provider_key: bool = False) -> None:
        """Leave the record UNCERTAIN after a failure that followed ``begin_external()``.

        For the package's run loops (a view's, a task's), not for views: one
        write (``store.mark_uncertain``) with everything this request began,
        written again because on SQLite, and inside a caller's transaction,
        the intents joined the failed transaction and rolled back with it:
        the record's provider key and id if it made its one call, and each
        step it began with its key and, when known, its provider's id.

        Args:
            with_provider_key: Write the record's provider key even though
                ``begin_external()`` was not called (an outcome policy judged
                the answer uncertain): the key the view could read, for the
                reconciler to ask the provider with.

        Raises:
            StaleOwner: The record was taken over meanwhile.
            DatabaseError: The store could not be written.
        """
        steps = tuple(
            StepWrite(step.name, step.provider_key, step.provider_operation_id)
            for step in self._begun_steps.values()
        )
        store.mark_uncertain(
            self._held,
            provider_key=(
                self.provider_key if self._record_call_begun or with_provider_key else ""
            ),
            provider_operation_id=self.provider_operation_id,
            steps=steps,
        )

    # For ``async def`` views: the same writes, on the request's sync thread
    # (where its transaction and connections live).
    async def abegin_external(
        self, *, step: str | None = None, lease: timedelta | float | None = None
    ) -> str:
        """``begin_external()`` for ``async def`` views, on the request's sync thread."""
        return await sync_to_async(self.begin_external, thread_sensitive=True)(
            step=step, lease=lease
        )

    async def aset_provider_operation(self, operation_id: str, *, step: str | None = None) -> None:
        """``set_provider_operation()`` for ``async def`` views, on the request's sync thread."""
        await sync_to_async(self.set_provider_operation, thread_sensitive=True)(
            operation_id, step=step
        )

    async def astep(self, name: str) -> IdempotencyStep | None:
        """``step()`` for ``async def`` views, on the request's sync thread."""
        return await sync_to_async(self.step, thread_sensitive=True)(name)

    async def arenew_lease(self) -> None:
        """``renew_lease()`` for ``async def`` views, on the request's sync thread."""
        await sync_to_async(self.renew_lease, thread_sensitive=True)()
