from __future__ import annotations

from datetime import datetime

from django.db import models
from django.utils.translation import gettext_lazy as _

from django_idempotency._names import OPERATION_MAX_LENGTH, TENANT_MAX_LENGTH

__all__ = [
    "FINGERPRINT_MAX_LENGTH",
    "KEY_MAX_LENGTH",
    "OPERATION_MAX_LENGTH",
    "RESOLVED_STATES",
    "STEP_NAME_MAX_LENGTH",
    "TENANT_MAX_LENGTH",
    "UNRESOLVED_STATES",
    "IdempotencyRecord",
    "IdempotencyStep",
]

#: Column sizes. The unique index spans all three scope columns, so their sum
#: has to stay inside MySQL/MariaDB's 3072-byte index limit at 4 bytes a
#: character: (128 + 255 + 255) * 4 = 2552. The tenant's and the operation's
#: (TENANT_MAX_LENGTH, OPERATION_MAX_LENGTH) are defined with the rule their
#: text obeys (``_names.py``), which decorators apply before models load.
KEY_MAX_LENGTH = 255
#: A secret's version (at most 16 characters), a colon, 64 hex digits; room to spare.
FINGERPRINT_MAX_LENGTH = 96
STEP_NAME_MAX_LENGTH = 64
"""The longest step name ``begin_external(step=...)`` takes ("authorize", "capture")."""


class IdempotencyRecord(models.Model):
    """One idempotent operation: who asked, what they asked, and the outcome.

    Unique on (``tenant``, ``operation``, ``key``). Only the package writes
    records; the admin shows them as a read-only log.

    Attributes:
        tenant (str): Who asked (``IDEMPOTENCY["TENANT"]``), up to 128 characters.
        operation (str): What for, up to 255 characters.
        key (str): The client's ``Idempotency-Key``, up to 255 characters.
        fingerprint (str): A keyed digest of the request's canonical input,
            ``"<version>:<hex>"``.
        state (str): One of ``State``.
        lease_owner (str): ``host:pid:thread`` of the owner, or
            ``operator:<username>``; empty when resolved.
        lease_expires_at (datetime | None): The end of the lease; NULL when resolved.
        fencing_token (int): Moved on by every takeover; an owner's writes are
            conditional on it.
        provider_key (str): The key given to the external provider, set by
            ``begin_external()``.
        provider_operation_id (str): The provider's id for the call, set by
            ``set_provider_operation()``.
        response_status (int | None): The stored status.
        response_headers (list[list[str]]): The stored headers, ``[[name, value], ...]``.
        response_body (bytes | memoryview | None): The stored body (a
            ``memoryview`` as PostgreSQL returns it); NULL on a resolved
            record when it was not stored (too large, or streamed).
        response_sealed (bool): Whether the stored response is encrypted
            (``ENCRYPTION_KEYS``).
        created_at (datetime): When the record was claimed.
        updated_at (datetime): When it was last written.
        expires_at (datetime): When a resolved record stops being replayed and may be
            purged; for a tombstone, when the tombstone goes.
        tombstone (bool): The purge dropped the stored response past retention
            and kept the scope and fingerprint until ``expires_at`` (moved on by
            ``IDEMPOTENCY["TOMBSTONE_TTL"]``), so that a late retry is refused
            (``idempotency_key_expired``) instead of running again.
        principal_digest (str | None): A keyed digest of the principal that
            sent the first request, ``"<version>:<hex>"``; NULL when there was
            none (an anonymous request) or an earlier release wrote the record.
        credential_digest (str | None): A keyed digest of the credential the
            first request presented, kept only by views that rotate or revoke
            it (``credential_rotation``); NULL otherwise.
    """

    class State(models.TextChoices):
        """A record's state: CLAIMED, IN_PROGRESS or UNCERTAIN (unresolved), COMPLETED or FAILED."""

        CLAIMED = "CLAIMED", _("claimed")
        IN_PROGRESS = "IN_PROGRESS", _("in progress")
        UNCERTAIN = "UNCERTAIN", _("uncertain")
        COMPLETED = "COMPLETED", _("completed")
        FAILED = "FAILED", _("failed")

    tenant = models.CharField(_("tenant"), max_length=TENANT_MAX_LENGTH)
    operation = models.CharField(_("operation"), max_length=OPERATION_MAX_LENGTH)
    key = models.CharField(_("idempotency key"), max_length=KEY_MAX_LENGTH)
    #: ``"<version>:<hex>"`` (``digests.py``); 64 bare hex digits if an older
    #: release wrote it.
    fingerprint = models.CharField(_("request fingerprint"), max_length=FINGERPRINT_MAX_LENGTH)
    state = models.CharField(_("state"), max_length=16, choices=State.choices)
    lease_owner = models.CharField(_("lease owner"), max_length=255, blank=True)
    lease_expires_at = models.DateTimeField(_("lease expires at"), null=True, blank=True)
    fencing_token = models.PositiveBigIntegerField(_("fencing token"), default=1)
    provider_key = models.CharField(_("provider key"), max_length=64, blank=True)
    provider_operation_id = models.CharField(_("provider operation id"), max_length=255, blank=True)
    response_status = models.PositiveSmallIntegerField(_("response status"), null=True, blank=True)
    #: ``[[name, value], ...]`` in the order the view set them.
    response_headers = models.JSONField(_("response headers"), default=list, blank=True)
    #: NULL on a resolved record means the body was not stored (too large or
    #: streamed); an empty body is stored as ``b""``.
    response_body = models.BinaryField(_("response body"), null=True, blank=True)
    #: Whether the headers and body are encrypted (``store/sealing.py``): then the
    #: headers are empty and the body holds one token of both.
    response_sealed = models.BooleanField(_("response encrypted"), default=False, db_default=False)
    created_at = models.DateTimeField(_("created at"))
    updated_at = models.DateTimeField(_("updated at"))
    expires_at = models.DateTimeField(_("expires at"))
    #: A resolved record whose response the purge dropped (``TOMBSTONE_TTL``);
    #: not a state: it stays COMPLETED or FAILED, and only the purge sets it.
    tombstone = models.BooleanField(_("tombstone"), default=False, db_default=False)
    # NULL, not "": nothing is known (a record of an earlier release, an
    # anonymous request, a view that does not rotate credentials), and a
    # NULL never equals anything, in SQL or in the digests' comparison.
    #: A keyed digest of who sent the first request (``scope.principal_of``):
    #: a retry DRF's permission check refuses is replayed only to that principal.
    principal_digest = models.CharField(  # noqa: DJ001
        _("principal digest"), max_length=FINGERPRINT_MAX_LENGTH, null=True, blank=True
    )
    #: A keyed digest of the credential the first request presented, kept by
    #: views that rotate or revoke it (``credential_rotation``).
    credential_digest = models.CharField(  # noqa: DJ001
        _("credential digest"), max_length=FINGERPRINT_MAX_LENGTH, null=True, blank=True
    )

    #: Not a column: the records database's time when ``store.lookup()`` read
    #: this record, which its lease and retention are judged against (never
    #: this host's clock); ``None`` on records read otherwise.
    read_at: datetime | None = None

    class Meta:
        verbose_name = _("idempotency record")
        verbose_name_plural = _("idempotency records")
        db_table = "django_idempotency_record"
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "operation", "key"],
                name="django_idempotency_unique_scope",
            ),
        ]
        indexes = [
            # Each index takes an entry from every row version its condition
            # holds for: the completion's UPDATE changes ``state``, so it is
            # never HOT, and it would add one to every index without one.
            # Partial, a first execution adds one entry to each of these two
            # (the claim to the first, the completion to the second) instead
            # of two to each. MySQL and MariaDB have no partial indexes: they
            # keep (state, lease_expires_at) and (expires_at) (migration 0009).
            # Recovery: unresolved records whose lease ran out, oldest lease first.
            models.Index(
                fields=["lease_expires_at"],
                name="idempotency_unresolved_lease",
                condition=models.Q(state__in=["CLAIMED", "IN_PROGRESS", "UNCERTAIN"]),
            ),
            # The purge and the admin's retention filters: resolved records by expiry.
            models.Index(
                fields=["expires_at"],
                name="idempotency_resolved_expiry",
                condition=models.Q(state__in=["COMPLETED", "FAILED"]),
            ),
            # The admin: its operation filter (newest first) and exact search.
            models.Index(fields=["operation", "id"], name="idempotency_operation"),
            models.Index(fields=["key"], name="idempotency_key"),
            # Most records never call out: index only those that did.
            models.Index(
                fields=["provider_key"],
                name="idempotency_provider_key",
                condition=~models.Q(provider_key=""),
            ),
            models.Index(
                fields=["provider_operation_id"],
                name="idempotency_provider_op",
                condition=~models.Q(provider_operation_id=""),
            ),
        ]
        # One per resolving admin action, so each can be granted on its own.
        permissions = [
            ("reconcile_idempotencyrecord", _("Can reconcile idempotency records")),
            ("mark_failed_idempotencyrecord", _("Can mark idempotency records failed")),
            ("mark_completed_idempotencyrecord", _("Can mark idempotency records completed")),
            ("release_idempotencyrecord", _("Can release idempotency records")),
            ("extend_idempotencyrecord", _("Can extend the retention of idempotency records")),
            (
                "view_decrypted_idempotencyrecord",
                _("Can view the decrypted stored responses of idempotency records"),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.operation} {self.key!r} ({self.state})"

    @property
    def is_resolved(self) -> bool:
        """Whether the state is COMPLETED or FAILED: an outcome is stored."""
        return self.state in RESOLVED_STATES


class IdempotencyStep(models.Model):
    """One external call of a multi-step operation: ``begin_external(step=...)``.

    A row of its own per (record, step), committed before the call like the
    record's intent, and deleted with its record by the database itself
    (``ON DELETE CASCADE``, or a trigger on SQLite: migration 0006), so that
    the store's one-statement DELETE statements need no second statement.

    Attributes:
        record (IdempotencyRecord): The operation the step belongs to.
        name (str): The step's name, as the view gave it (``"authorize"``).
        provider_key (str): The key given to the provider for this step,
            derived from the scoped key and the step's name.
        provider_operation_id (str): The provider's id for the step's call,
            set by ``set_provider_operation(id, step=...)``; empty until then.
        begun_at (datetime): When the step's intent was first committed.
        updated_at (datetime): When the step was last written.
    """

    # The constraint is the migration's own (Django 5.2 and 6.0 cannot ask
    # for ON DELETE CASCADE in the database): to Django the column is a
    # plain reference, and its collector never SELECTs steps to delete them.
    record = models.ForeignKey(
        IdempotencyRecord,
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        related_name="steps",
        verbose_name=_("record"),
    )
    name = models.CharField(_("step"), max_length=STEP_NAME_MAX_LENGTH)
    provider_key = models.CharField(_("provider key"), max_length=64)
    provider_operation_id = models.CharField(_("provider operation id"), max_length=255, blank=True)
    begun_at = models.DateTimeField(_("begun at"))
    updated_at = models.DateTimeField(_("updated at"))

    class Meta:
        verbose_name = _("idempotency step")
        verbose_name_plural = _("idempotency steps")
        db_table = "django_idempotency_step"
        constraints = [
            # Also the index the cascade and ``record.steps`` use.
            models.UniqueConstraint(
                fields=["record", "name"], name="django_idempotency_unique_step"
            ),
        ]
        indexes = [
            models.Index(
                fields=["provider_operation_id"],
                name="idempotency_step_provider_op",
                condition=~models.Q(provider_operation_id=""),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.provider_operation_id or 'no provider id'})"


RESOLVED_STATES = (IdempotencyRecord.State.COMPLETED, IdempotencyRecord.State.FAILED)
"""The final states: the outcome is stored and replayed to every retry.

Filter with these (``state__in=RESOLVED_STATES``) rather than listing states.
"""

UNRESOLVED_STATES = (
    IdempotencyRecord.State.CLAIMED,
    IdempotencyRecord.State.IN_PROGRESS,
    IdempotencyRecord.State.UNCERTAIN,
)
"""Somebody holds or held the key and nothing is stored yet.

The owner, a reconciler or an operator settles it.
"""
