"""The record store: the only code that writes ``IdempotencyRecord`` rows.

Everything else (the request path, task protection, recovery, the admin,
the management commands) reads records through the ORM at most, and
changes them only by calling the functions exported here:

- ``claims``: winning a key (an atomic INSERT), taking an abandoned one
  over, finding the record that holds it;
- ``owner_writes``: what the owner of a claim writes, each write
  conditional on its fencing token;
- ``finished``: the optimistic mode's one INSERT of a finished record,
  and the DELETE of an expired one it replaces;
- ``presented``: the record a retry whose authentication failed may be
  answered with, found by the credential it presented;
- ``steps``: the rows of a multi-step operation's steps, written only
  alongside their record's fenced write;
- ``maintenance``: recovery's and operators' takeovers, retention, key
  rotation;
- ``conditional``: the compare-and-set and the conditional DELETE those
  are built on;
- ``statements``: the hot path's SQL, per database vendor;
- ``connections``: the second connection that commits an intent while the
  view's transaction is open;
- ``sealing``: encryption of stored responses at rest;
- ``digests``: the keyed, versioned digests of fingerprints and provider
  keys;
- ``routing``: which database holds a record (one alias, or the routers');
- ``errors``: telling an outage from contention;
- ``database_time`` and ``clock``: every lease and retention decision is
  judged by the database's clock;
- ``wait_bounds``: how long a statement may wait on other sessions;
- ``checks``: the system checks of the settings the store reads.

Imported by the request path, recovery, the purge, the admin and the
commands; it imports only ``models``, ``conf``, ``exceptions``,
``responses`` and ``scope`` of the package. Private: import it as ``from
django_idempotency import _store as store`` and call
``store.claim(...)``; its modules may change in any release.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from django_idempotency._store.claims import (
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
        lookup_to_answer,
        past_retention,
        take_over,
    )
    from django_idempotency._store.connections import (
        close_independent_connections,
        commit_now_alias,
        snapshot_isolated,
    )
    from django_idempotency._store.finished import (
        discard_expired_waiting_at_most,
        record_finished,
    )
    from django_idempotency._store.maintenance import (
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
    from django_idempotency._store.owner_writes import (
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
    from django_idempotency._store.presented import finished_for_credential
    from django_idempotency._store.sealing import UnreadableRecord, unseal
    from django_idempotency._store.steps import StepWrite, steps_of
    from django_idempotency.models import RESOLVED_STATES, UNRESOLVED_STATES

# Where each name of the facade lives. Loaded at first use: the store's
# writing modules import the models, and the helpers beside them (errors,
# clock, digests, wait bounds) are imported before ``django.setup()``
# (settings files import ``django_idempotency.tasks``).
_HOMES = {
    "Attempt": "django_idempotency._store.claims",
    "Claim": "django_idempotency._store.claims",
    "MAX_RECLAIMS": "django_idempotency._store.claims",
    "PurgedBatch": "django_idempotency._store.maintenance",
    "RESOLVED_STATES": "django_idempotency.models",
    "ResealBatch": "django_idempotency._store.maintenance",
    "StepWrite": "django_idempotency._store.steps",
    "UNRESOLVED_STATES": "django_idempotency.models",
    "UnreadableRecord": "django_idempotency._store.sealing",
    "abandoned": "django_idempotency._store.claims",
    "begin_external": "django_idempotency._store.owner_writes",
    "begin_step": "django_idempotency._store.owner_writes",
    "claim": "django_idempotency._store.claims",
    "claim_or_find": "django_idempotency._store.claims",
    "claim_or_take_over": "django_idempotency._store.claims",
    "close_independent_connections": "django_idempotency._store.connections",
    "commit_now_alias": "django_idempotency._store.connections",
    "complete": "django_idempotency._store.owner_writes",
    "discard_expired": "django_idempotency._store.claims",
    "discard_expired_waiting_at_most": "django_idempotency._store.finished",
    "expire_leases": "django_idempotency._store.maintenance",
    "extend_retention": "django_idempotency._store.maintenance",
    "finished_for_credential": "django_idempotency._store.presented",
    "forgotten": "django_idempotency._store.claims",
    "hand_back": "django_idempotency._store.owner_writes",
    "handed_back": "django_idempotency._store.claims",
    "kept_as_tombstone": "django_idempotency._store.claims",
    "lease_owner": "django_idempotency._store.claims",
    "lookup": "django_idempotency._store.claims",
    "lookup_to_answer": "django_idempotency._store.claims",
    "mark_uncertain": "django_idempotency._store.owner_writes",
    "note_provider_operation": "django_idempotency._store.owner_writes",
    "past_retention": "django_idempotency._store.claims",
    "postpone": "django_idempotency._store.owner_writes",
    "purge_expired_batch": "django_idempotency._store.maintenance",
    "purge_to_tombstones_batch": "django_idempotency._store.maintenance",
    "record_finished": "django_idempotency._store.finished",
    "release": "django_idempotency._store.owner_writes",
    "renew_lease": "django_idempotency._store.owner_writes",
    "reseal_batch": "django_idempotency._store.maintenance",
    "set_provider_operation": "django_idempotency._store.owner_writes",
    "set_step_provider_operation": "django_idempotency._store.owner_writes",
    "snapshot_isolated": "django_idempotency._store.connections",
    "steps_of": "django_idempotency._store.steps",
    "take_over": "django_idempotency._store.claims",
    "take_over_for_operator": "django_idempotency._store.maintenance",
    "take_over_next_stale": "django_idempotency._store.maintenance",
    "unseal": "django_idempotency._store.sealing",
}

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
    "discard_expired_waiting_at_most",
    "expire_leases",
    "extend_retention",
    "finished_for_credential",
    "forgotten",
    "hand_back",
    "handed_back",
    "kept_as_tombstone",
    "lease_owner",
    "lookup",
    "lookup_to_answer",
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


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # once: later lookups are plain attribute reads
    return value
