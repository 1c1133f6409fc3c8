"""The rows of a multi-step operation's steps: ``begin_external(step=...)``.

Only the store writes steps, and only inside a transaction that also holds
the fenced write of their record (``owner_writes``): the record's row is
locked by that UPDATE until the transaction ends, so two writers of one
record's steps never interleave, and a stale owner (whose fenced UPDATE
matched no row) writes no step at all.

Steps go with their record inside the database (migration 0006: ``ON
DELETE CASCADE``, a trigger on SQLite): nothing here deletes them on a
record's release or purge.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from django.db.models import QuerySet

from django_idempotency._store.database_time import DatabaseNow
from django_idempotency.models import IdempotencyStep


@dataclass(frozen=True)
class StepWrite:
    """What an owner knows of one step it began: written again after a rollback."""

    name: str
    provider_key: str
    provider_operation_id: str = ""


def steps_of(record_id: int, *, using: str) -> QuerySet[IdempotencyStep]:
    """A record's steps in the order they were begun (first begin; then insertion)."""
    steps = IdempotencyStep.objects.using(using).filter(record_id=record_id)
    return steps.order_by("begun_at", "pk")


def insert_step(record_id: int, name: str, provider_key: str, *, using: str) -> None:
    """The first ``begin_external(step=name)`` of a record: one INSERT."""
    IdempotencyStep.objects.using(using).create(
        record_id=record_id,
        name=name,
        provider_key=provider_key,
        begun_at=DatabaseNow(),
        updated_at=DatabaseNow(),
    )


def touch_step(record_id: int, name: str, *, using: str) -> int:
    """A stored step begun again (its key kept): one UPDATE; how many rows it matched."""
    return (
        IdempotencyStep.objects.using(using)
        .filter(record_id=record_id, name=name)
        .update(updated_at=DatabaseNow())
    )


def record_step_provider_operation(
    record_id: int, name: str, operation_id: str, *, using: str
) -> int:
    """Store the provider's id of a step; how many rows it matched (0: no such step)."""
    return (
        IdempotencyStep.objects.using(using)
        .filter(record_id=record_id, name=name)
        .update(provider_operation_id=operation_id, updated_at=DatabaseNow())
    )


def write_steps_again(record_id: int, steps: Iterable[StepWrite], *, using: str) -> None:
    """Make sure each step is stored as its owner knows it, in the order given.

    After a rollback (SQLite, or a caller's transaction: the steps' first
    writes joined the view's transaction) the rows are gone; elsewhere they
    committed and only a provider id may be missing. An UPDATE, then an
    INSERT where it matched nothing: the failure path, where a statement
    more does not matter and every vendor runs the same SQL.
    """
    for step in steps:
        if step.provider_operation_id:
            matched = record_step_provider_operation(
                record_id, step.name, step.provider_operation_id, using=using
            )
        else:
            matched = touch_step(record_id, step.name, using=using)
        if not matched:
            IdempotencyStep.objects.using(using).create(
                record_id=record_id,
                name=step.name,
                provider_key=step.provider_key,
                provider_operation_id=step.provider_operation_id,
                begun_at=DatabaseNow(),
                updated_at=DatabaseNow(),
            )


def forget_steps(
    record_id: int, *, keep: Iterable[str], provider_operation_ids: Mapping[str, str], using: str
) -> None:
    """Delete every step but ``keep``; store the provider ids a reconciler found for kept ones."""
    kept = list(keep)
    IdempotencyStep.objects.using(using).filter(record_id=record_id).exclude(
        name__in=kept
    )._raw_delete(using)
    for name, operation_id in provider_operation_ids.items():
        record_step_provider_operation(record_id, name, operation_id, using=using)
