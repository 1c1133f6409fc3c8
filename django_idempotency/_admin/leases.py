"""How the admin names an unresolved record's lease: who, if anyone, is at work on it.

One word per record, the same in the list and on the overview page, so
that an operator reads the lease of a record as the *stuck* count
(``census.stuck``) judges it.
"""

from __future__ import annotations

from datetime import datetime

from django.utils.translation import gettext as _

from django_idempotency._store.database_time import instant
from django_idempotency.models import RESOLVED_STATES, IdempotencyRecord


def lease_label(record: IdempotencyRecord, now: datetime) -> str:
    """``"held"``, ``"postponed"``, ``"expired"``, or ``"-"`` once resolved (or leaseless).

    ``now``: the records database's time the record was read at. An
    UNCERTAIN record with a lease still running and no owner is one
    recovery postponed (no reconciler, a ``Retry``): nobody is at work on
    it, and calling that lease "held" sent operators away from it.
    """
    if record.state in RESOLVED_STATES or record.lease_expires_at is None:
        return "-"
    # Instants, not wall times: PostgreSQL under USE_TZ=False in a zone with
    # daylight saving hands back naive times the repeated hour makes ambiguous.
    using = record._state.db or "default"
    if instant(record.lease_expires_at, using) <= instant(now, using):
        return _("expired")
    if record.state == IdempotencyRecord.State.UNCERTAIN and not record.lease_owner:
        return _("postponed")
    return _("held")
