"""The record store: the only code that writes ``IdempotencyRecord`` rows.

Everything else (the request path, task protection, recovery, the admin,
the management commands) reads records through the ORM at most, and
changes them only by calling the functions exported here:

- ``claims``: winning a key (an atomic INSERT), taking an abandoned one
  over, finding the record that holds it;
- ``owner_writes``: what the owner of a claim writes, each write
  conditional on its fencing token;
- ``finished``: the optimistic mode's one INSERT of a finished record,
  and the lookup that opens its transaction;
- ``steps``: the rows of a multi-step operation's steps, written only
  alongside their record's fenced write;
- ``maintenance``: recovery's and operators' takeovers, retention, key
  rotation;
- ``conditional``: the compare-and-set and the conditional DELETE those
  are built on;
- ``statements``: the hot path's SQL, per database vendor;
- ``connections``: the second connection that commits an intent while the
  view's transaction is open;
- ``sealing``: encryption of stored responses at rest.

A private package: import it as ``from django_idempotency import store``
and call ``store.claim(...)``; its modules may change between releases.
"""

from __future__ import annotations

from django_idempotency.models import RESOLVED_STATES, UNRESOLVED_STATES
from django_idempotency.store.claims import (
    MAX_RECLAIMS,
    Attempt,
    Claim,
    abandoned,
    claim,
    claim_or_find,
    claim_or_take_over,
    discard_expired,
    forgotten,
    handed_back,
    kept_as_tombstone,
    lease_owner,
    lookup,
    past_retention,
    take_over,
)
from django_idempotency.store.connections import (
    close_independent_connections,
    commit_now_alias,
    snapshot_isolated,
)
from django_idempotency.store.finished import lookup_waiting_at_most, record_finished
from django_idempotency.store.maintenance import (
    PurgedBatch,
    ResealBatch,
    expire_leases,
    extend_retention,
    purge_expired_batch,
    purge_to_tombstones_batch,
    reseal_batch,
    take_over_for_operator,
    take_over_next_stale,
)
from django_idempotency.store.owner_writes import (
    begin_external,
    begin_step,
    complete,
    hand_back,
    mark_uncertain,
    note_provider_operation,
    postpone,
    release,
    renew_lease,
    set_provider_operation,
    set_step_provider_operation,
)
from django_idempotency.store.sealing import UnreadableRecord, unseal
from django_idempotency.store.steps import StepWrite, steps_of

__all__ = [
    "MAX_RECLAIMS",
    "RESOLVED_STATES",
    "UNRESOLVED_STATES",
    "Attempt",
    "Claim",
    "PurgedBatch",
    "ResealBatch",
    "StepWrite",
    "UnreadableRecord",
    "abandoned",
    "begin_external",
    "begin_step",
    "claim",
    "claim_or_find",
    "claim_or_take_over",
    "close_independent_connections",
    "commit_now_alias",
    "complete",
    "discard_expired",
    "expire_leases",
    "extend_retention",
    "forgotten",
    "hand_back",
    "handed_back",
    "kept_as_tombstone",
    "lease_owner",
    "lookup",
    "lookup_waiting_at_most",
    "mark_uncertain",
    "note_provider_operation",
    "past_retention",
    "postpone",
    "purge_expired_batch",
    "purge_to_tombstones_batch",
    "record_finished",
    "release",
    "renew_lease",
    "reseal_batch",
    "set_provider_operation",
    "set_step_provider_operation",
    "snapshot_isolated",
    "steps_of",
    "take_over",
    "take_over_for_operator",
    "take_over_next_stale",
    "unseal",
]
