"""Errors. Every HTTP refusal is a DRF ``APIException`` with a stable ``code``.

They are raised, not returned, so that the project's own
``REST_FRAMEWORK['EXCEPTION_HANDLER']`` renders them. Their ``detail`` is a
dict so that DRF's default handler produces ``{"detail": ..., "code": ...}``.
"""

from __future__ import annotations

from django.core.exceptions import ImproperlyConfigured
from django.utils.translation import gettext
from django.utils.translation import gettext_lazy as _
from rest_framework import status
from rest_framework.exceptions import APIException

__all__ = [
    "REFUSAL_CODES",
    "UNREADABLE_RECORD",
    "BodyTooLarge",
    "DurableTransactionInView",
    "IdempotencyError",
    "IdempotencyRefusal",
    "InputUnreadable",
    "IsolationNotSupported",
    "KeyExpired",
    "KeyInvalid",
    "KeyMissing",
    "KeyReused",
    "OperationInvalid",
    "OutcomeUncertain",
    "RequestInProgress",
    "RolledBackResponse",
    "StaleOwner",
    "StoreUnavailable",
    "TaskFailed",
    "TaskInProgress",
    "TaskKeyMissing",
    "TaskKeyReused",
    "TaskOutcomeUncertain",
]


class IdempotencyError(Exception):
    """Base class of everything django-idempotency raises."""


class IdempotencyRefusal(IdempotencyError, APIException):
    """A request refused before (or instead of) running the protected view.

    Each subclass has a stable ``default_code`` (the body's ``code``) and a
    ``status_code``; the project's ``EXCEPTION_HANDLER`` renders it.

    Args:
        message: The body's ``detail``; ``None``: the class's default message.
        retry_after: Seconds for the ``Retry-After`` header, if any.
    """

    default_code: str

    def __init__(self, message: str | None = None, *, retry_after: int | None = None) -> None:
        text = message or str(self.default_detail)
        #: The body's ``detail``, as text (``detail`` is DRF's dict of it and the code).
        self.message = str(text)
        super().__init__({"detail": text, "code": self.default_code}, self.default_code)
        if retry_after is not None:
            # DRF's exception handler turns ``wait`` into a Retry-After header.
            self.wait = retry_after


class KeyMissing(IdempotencyRefusal):
    """400 ``idempotency_key_missing``: the operation requires a key and none was sent."""

    status_code = status.HTTP_400_BAD_REQUEST
    default_code = "idempotency_key_missing"
    default_detail = _(
        "This operation requires an Idempotency-Key header. Send a unique key "
        "(a UUID is a good choice) and reuse it only to retry the same request."
    )


class KeyInvalid(IdempotencyRefusal):
    """400 ``idempotency_key_invalid``: the key is empty, too long or malformed.

    A key is 1 to ``KEY_MAX_LENGTH`` visible ASCII characters other than the
    comma, sent bare or as a quoted string.
    """

    status_code = status.HTTP_400_BAD_REQUEST
    default_code = "idempotency_key_invalid"
    default_detail = _(
        "The Idempotency-Key header must be visible ASCII characters, at most "
        'IDEMPOTENCY["KEY_MAX_LENGTH"] of them, optionally sent as a quoted string.'
    )


class OperationInvalid(IdempotencyRefusal):
    """400 ``idempotency_operation_invalid``: no record can hold this operation name.

    An operation name is 1 to 255 printable characters. One computed from
    the request (its URL path where the route has no pattern, or an
    ``operation=`` callable's answer), or the status view's ``operation``
    parameter, that is not, is refused before any record is read or written.
    """

    status_code = status.HTTP_400_BAD_REQUEST
    default_code = "idempotency_operation_invalid"
    default_detail = _(
        "The operation this request names is not one a record can hold: an operation "
        "name is 1 to 255 printable characters (no control characters)."
    )


class InputUnreadable(IdempotencyRefusal):
    """400 ``parse_error``: the body holds a value with no canonical form (``1e999``).

    Or it is nested too deeply to be read.
    """

    status_code = status.HTTP_400_BAD_REQUEST
    # DRF's own code for a body it cannot parse: clients already handle it.
    default_code = "parse_error"
    default_detail = _(
        "The request body holds a number with no finite value (such as 1e999), or is "
        "nested too deeply to be read."
    )


class BodyTooLarge(IdempotencyRefusal):
    """413 ``idempotency_body_too_large``: larger than ``MAX_FINGERPRINTED_BODY``."""

    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_code = "idempotency_body_too_large"
    default_detail = _(
        "The request body is larger than an idempotent request may be "
        '(IDEMPOTENCY["MAX_FINGERPRINTED_BODY"]).'
    )


class KeyReused(IdempotencyRefusal):
    """422 ``idempotency_key_reused``: the key was used with a different request."""

    status_code = status.HTTP_422_UNPROCESSABLE_ENTITY
    default_code = "idempotency_key_reused"
    default_detail = _(
        "This Idempotency-Key was already used with a different request. Use a "
        "new key for a new request; retry only with the identical request."
    )

    @classmethod
    def from_source(cls, source: str | None) -> KeyReused:
        """The refusal of a key read from ``source`` ("the body field 'id'").

        ``None``: the client's Idempotency-Key header, the default message. A
        webhook's sender sent no such header, and is told where its key came from.
        """
        if source is None:
            return cls()
        return cls(
            gettext(
                "This key (%(source)s) was already used with a different request, so "
                "this request was not run. Only the identical request may be sent again "
                "with it."
            )
            % {"source": source}
        )


class KeyExpired(IdempotencyRefusal):
    """422 ``idempotency_key_expired``: the key's operation is past retention.

    Answered only with ``IDEMPOTENCY["TOMBSTONE_TTL"]`` set, to a retry of
    the same request after its stored response was dropped (or is due to
    be): the operation happened, and running it again would do it twice.
    422, as for a reused key, rather than 410: the target resource is still
    there (410 speaks of the URL, and is cacheable by default), and a client
    must likewise stop retrying with this key.
    """

    status_code = status.HTTP_422_UNPROCESSABLE_ENTITY
    default_code = "idempotency_key_expired"
    default_detail = _(
        "This Idempotency-Key was used for a request that was processed, and its "
        "outcome is no longer kept. The request was not run again: look up its "
        "outcome rather than sending it with a new key."
    )

    @classmethod
    def from_source(cls, source: str | None) -> KeyExpired:
        """The refusal of a key read from ``source``; ``None``: the Idempotency-Key header."""
        if source is None:
            return cls()
        return cls(
            gettext(
                "This key (%(source)s) was used for a request that was processed, and "
                "its outcome is no longer kept. The request was not run again."
            )
            % {"source": source}
        )


class RequestInProgress(IdempotencyRefusal):
    """409 ``idempotency_request_in_progress``: a request with this key is running.

    Sent with ``Retry-After``. (A record left UNCERTAIN runs no more: its
    retries get ``OutcomeUncertain``.)
    """

    status_code = status.HTTP_409_CONFLICT
    default_code = "idempotency_request_in_progress"
    default_detail = _(
        "A request with this Idempotency-Key is still being processed. Retry "
        "after the time given in Retry-After to receive its outcome."
    )


class StoreUnavailable(IdempotencyRefusal):
    """503 ``idempotency_store_unavailable``: the record could not be stored or read.

    Sent with ``Retry-After``. With ``FAIL_OPEN`` the view runs unprotected
    instead when the store is down.
    """

    status_code = status.HTTP_503_SERVICE_UNAVAILABLE
    default_code = "idempotency_store_unavailable"
    default_detail = _(
        "The request was not run because its idempotency record could not be "
        "stored. Retry later with the same Idempotency-Key."
    )


class OutcomeUncertain(IdempotencyRefusal):
    """503 ``idempotency_outcome_uncertain``: the view ran; whether it took effect is unknown.

    An external call was begun and the outcome could not be recorded, or the
    final commit was interrupted: the record is left for recovery (or is
    already settled), and a retry with the same key learns which. Retries
    of a record left UNCERTAIN get it too, until a reconciler or an
    operator settles it, with ``Retry-After`` saying when recovery next
    looks at it.
    """

    status_code = status.HTTP_503_SERVICE_UNAVAILABLE
    default_code = "idempotency_outcome_uncertain"
    default_detail = _(
        "The request was run, but its outcome is not known yet: it may or may not have "
        "taken effect. Retry after the time given in Retry-After with the same "
        "Idempotency-Key to learn it; do not send it again with a new key."
    )


class RolledBackResponse(IdempotencyError):
    """A success answered from a transaction that was marked for rollback.

    The view caught a database error without a savepoint (``try: ... except
    IntegrityError: pass``), so its writes are discarded: storing its 2xx
    would replay a success that never happened. Wrap the statement that may
    fail in its own ``transaction.atomic()`` block.
    """


class IsolationNotSupported(IdempotencyError, ImproperlyConfigured):
    """``begin_external()`` in a PostgreSQL transaction above READ COMMITTED.

    The intent is committed on a second connection while the view's
    transaction is open; at REPEATABLE READ or SERIALIZABLE the completion
    would then fail with a serialization error after the external call.
    """


#: ``StoreUnavailable``'s message for a retry whose stored response no
#: configured key decrypts (``ENCRYPTION_KEYS`` lost the key it was sealed with).
UNREADABLE_RECORD = _(
    "This request was already processed, but its stored response cannot be read: the "
    "encryption key it was stored with is missing from the server's configuration. Retry "
    "later with the same Idempotency-Key; the error is logged for the operators."
)


class DurableTransactionInView(IdempotencyError, RuntimeError):
    """A protected view opened ``transaction.atomic(durable=True)`` on a database it runs in.

    A protected view runs inside the transaction that commits its writes
    together with its outcome, so no block in it is the outermost one that
    ``durable=True`` demands: Django refuses it, at every retry. The claim
    is released (the block ran nothing), and this names the view and the
    fix (docs/transactions.md). A ``RuntimeError``, as Django's own refusal
    (kept as its ``__cause__``) is.
    """


class TaskInProgress(IdempotencyError):
    """The same message is being handled by another worker right now.

    Let Celery retry it later: ``autoretry_for=(TaskInProgress,)``. Under
    Django's Tasks framework, which retries nothing, the run's result is
    FAILED with this exception: enqueue the task again later.
    """


class TaskKeyReused(IdempotencyError):
    """A message reused a key with different arguments: a producer bug."""


class TaskKeyMissing(IdempotencyError):
    """A message came without a key: its key argument is ``None`` or empty.

    Or the ``key=`` callable returned one of those. A producer bug: nothing
    ran and nothing was kept. Messages without an id are no duplicates of
    one another, so none is kept under a made-up key (``"None"``) whose
    result another would get.
    """


class TaskOutcomeUncertain(IdempotencyError):
    """The message's external call may have happened: no run of it will call again.

    A run of the same key began an external call (``begin_external()``) and
    then died or failed, so the record is UNCERTAIN, or IN_PROGRESS with its
    owner's lease run out. The body is not run again; the reconciler
    registered for the task's operation settles the record, and the
    duplicates delivered after that get its result.

    Not a ``TaskInProgress``, on purpose: ``autoretry_for=(TaskInProgress,)``
    with ``max_retries=None`` would otherwise retry without end when no
    reconciler settles the record. To have the message wait for the
    reconciler's answer, list it in ``autoretry_for`` with a bounded
    ``max_retries`` (docs/celery-consumers.md).
    """


class TaskFailed(IdempotencyError):
    """The task's record was settled as FAILED (by its reconciler's ``Failed``).

    Raised to every delivery of the message after that: the operation
    definitively failed, and running the body again would not be the same
    operation.

    Attributes:
        result: The stored body, decoded from JSON (``None`` if not JSON).
    """

    def __init__(self, message: str, result: object = None) -> None:
        super().__init__(message)
        self.result = result


class StaleOwner(IdempotencyError):
    """An owner's write found the record's fencing token moved on: it lost the lease."""


REFUSAL_CODES = frozenset(
    refusal.default_code
    for refusal in (
        KeyMissing,
        KeyInvalid,
        OperationInvalid,
        BodyTooLarge,
        KeyReused,
        KeyExpired,
        RequestInProgress,
        StoreUnavailable,
        OutcomeUncertain,
    )
)
"""The ``code`` of every refusal the package answers itself.

Not ``InputUnreadable``'s: it is DRF's own ``parse_error``, which a view's
parser answers too.
"""
