"""Adding and removing an index on a large, busy table without blocking its writes.

A plain ``CREATE INDEX`` on PostgreSQL holds a SHARE lock on the table for
the whole build: every INSERT and UPDATE waits, which for the records' table
means every claim and every completion of every protected view, for as long
as the build takes on millions of rows. A rolling deploy runs ``migrate``
while the previous release still serves, so the package's own migrations
must not do that. ``AddIndexWithoutBlocking`` builds the index

- on PostgreSQL with ``CREATE INDEX CONCURRENTLY``: a SHARE UPDATE EXCLUSIVE
  lock, which writes do not conflict with. It cannot run inside a
  transaction, so the migration that uses it must say ``atomic = False``
  (checked here, with a message that says so, instead of PostgreSQL's
  "cannot run inside a transaction block" half way through a migration).
  Django's own ``AddIndexConcurrently`` does the same but raises on every
  other database, and the package supports three;
- on MySQL and MariaDB with ``ALGORITHM=INPLACE, LOCK=NONE``: InnoDB builds a
  secondary index online by default already; saying so makes the server
  refuse (an error, before any change) instead of silently locking the table
  should it ever not be able to;
- on SQLite as Django's ``AddIndex`` does: one process writes at a time there
  anyway, and nothing is large.

A concurrent build that fails (cancelled, a deadlock, the session lost, a
duplicate in a unique index) leaves an INVALID index behind: never used by
queries, yet updated by every write, and in the way of the next attempt
(``IF NOT EXISTS`` would keep the broken one). Before building, the
operation looks the name up in ``pg_index``: an invalid index of that name is
dropped (concurrently) and built again; a valid one (an operator built it by
hand ahead of the deploy, see docs/upgrading.md) is kept as it is.

``vendors`` restricts an index to some databases (a BRIN index exists only on
PostgreSQL). Django's model state is the same for every database, so such an
index cannot be one of the model's ``Meta.indexes`` (every other database
would be asked to create it): the operation then leaves the model state
alone and only changes the database, and ``makemigrations`` stays quiet on
all of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from django.db import models
from django.db.migrations.operations import AddIndex, RemoveIndex
from django.db.migrations.state import ProjectState

__all__ = ["AddIndexWithoutBlocking", "RemoveIndexWithoutBlocking"]

#: Appended to MySQL's and MariaDB's CREATE INDEX: online, or an error.
_ONLINE = " ALGORITHM=INPLACE LOCK=NONE"


class _WithoutBlocking:
    """What adding and removing share: the vendor filter and the transaction check."""

    index: models.Index
    model_name: str
    vendors: tuple[str, ...] | None

    def _applies(self, schema_editor: Any) -> bool:
        return self.vendors is None or schema_editor.connection.vendor in self.vendors

    def _outside_a_transaction(self, schema_editor: Any) -> None:
        if schema_editor.connection.in_atomic_block:
            raise NotImplementedError(
                f"{type(self).__name__} builds the index {self.index.name!r} concurrently on "
                "PostgreSQL, which cannot run inside a transaction: give its migration "
                "atomic = False."
            )

    def _add(self, model: type[models.Model], schema_editor: Any) -> None:
        vendor = schema_editor.connection.vendor
        if vendor == "postgresql":
            self._outside_a_transaction(schema_editor)
            # sqlmigrate (collect_sql) prints what a database without the index runs.
            valid = None
            if not schema_editor.collect_sql:
                valid = _index_validity(schema_editor, model._meta.db_table, self.index.name)
            if valid:
                return
            if valid is False:
                schema_editor.remove_index(model, self.index, concurrently=True)
            schema_editor.add_index(model, self.index, concurrently=True)
        elif vendor == "mysql":
            if self.index.contains_expressions and not (
                schema_editor.connection.features.supports_expression_indexes
            ):
                return  # as Django's add_index() does
            schema_editor.execute(f"{self.index.create_sql(model, schema_editor)}{_ONLINE}")
        else:
            schema_editor.add_index(model, self.index)

    def _remove(self, model: type[models.Model], schema_editor: Any) -> None:
        if schema_editor.connection.vendor == "postgresql":
            self._outside_a_transaction(schema_editor)
            # DROP INDEX CONCURRENTLY IF EXISTS: a build that never finished is gone too.
            schema_editor.remove_index(model, self.index, concurrently=True)
        else:
            schema_editor.remove_index(model, self.index)

    def _vendors_note(self) -> str:
        return f" (on {', '.join(self.vendors)} only)" if self.vendors else ""


def _index_validity(schema_editor: Any, table: str, name: str) -> bool | None:
    """Whether the index ``name`` on ``table`` is valid; None when there is none."""
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(
            "SELECT i.indisvalid FROM pg_index i "
            "JOIN pg_class c ON c.oid = i.indexrelid "
            "WHERE c.relname = %s AND i.indrelid = to_regclass(%s)",
            [name, schema_editor.quote_name(table)],
        )
        row = cursor.fetchone()
    return None if row is None else bool(row[0])


class AddIndexWithoutBlocking(_WithoutBlocking, AddIndex):
    """``AddIndex`` that lets writes go on meanwhile; its migration needs ``atomic = False``.

    Args:
        model_name: As for ``AddIndex``.
        index: As for ``AddIndex``.
        vendors: The databases (``connection.vendor``) that get the index;
            None for all. When given, the model state is left alone: the
            index is not one of the model's ``Meta.indexes``.
    """

    def __init__(
        self, model_name: str, index: models.Index, vendors: Iterable[str] | None = None
    ) -> None:
        super().__init__(model_name, index)
        self.vendors = tuple(vendors) if vendors is not None else None

    def deconstruct(self) -> tuple[str, Sequence[Any], dict[str, Any]]:
        name, args, kwargs = super().deconstruct()
        if self.vendors is not None:
            kwargs["vendors"] = list(self.vendors)
        return name, args, kwargs

    def state_forwards(self, app_label: str, state: ProjectState) -> None:
        if self.vendors is None:
            super().state_forwards(app_label, state)

    def database_forwards(
        self, app_label: str, schema_editor: Any, from_state: ProjectState, to_state: ProjectState
    ) -> None:
        model = to_state.apps.get_model(app_label, self.model_name)
        if self.allow_migrate_model(schema_editor.connection.alias, model) and self._applies(
            schema_editor
        ):
            self._add(model, schema_editor)

    def database_backwards(
        self, app_label: str, schema_editor: Any, from_state: ProjectState, to_state: ProjectState
    ) -> None:
        model = from_state.apps.get_model(app_label, self.model_name)
        if self.allow_migrate_model(schema_editor.connection.alias, model) and self._applies(
            schema_editor
        ):
            self._remove(model, schema_editor)

    def describe(self) -> str:
        return f"{super().describe()} without blocking writes{self._vendors_note()}"

    def reduce(self, operation: Any, app_label: str) -> Any:
        # Never merged into a plain CreateModel/AddIndex by squashmigrations:
        # that would lose the concurrency (and the vendor filter).
        return False


class RemoveIndexWithoutBlocking(_WithoutBlocking, RemoveIndex):
    """``RemoveIndex`` that lets writes go on meanwhile (``DROP INDEX CONCURRENTLY``).

    Args:
        model_name: As for ``RemoveIndex``.
        index: The index as it was added (``RemoveIndex`` takes only its
            name, and reads the rest from the model state, where an index
            restricted to some ``vendors`` never was).
        vendors: As for ``AddIndexWithoutBlocking``.
    """

    def __init__(
        self, model_name: str, index: models.Index, vendors: Iterable[str] | None = None
    ) -> None:
        super().__init__(model_name, index.name)
        self.index = index
        self.vendors = tuple(vendors) if vendors is not None else None

    def deconstruct(self) -> tuple[str, Sequence[Any], dict[str, Any]]:
        kwargs: dict[str, Any] = {"model_name": self.model_name, "index": self.index}
        if self.vendors is not None:
            kwargs["vendors"] = list(self.vendors)
        return type(self).__name__, [], kwargs

    def state_forwards(self, app_label: str, state: ProjectState) -> None:
        if self.vendors is None:
            super().state_forwards(app_label, state)

    def database_forwards(
        self, app_label: str, schema_editor: Any, from_state: ProjectState, to_state: ProjectState
    ) -> None:
        model = from_state.apps.get_model(app_label, self.model_name)
        if self.allow_migrate_model(schema_editor.connection.alias, model) and self._applies(
            schema_editor
        ):
            self._remove(model, schema_editor)

    def database_backwards(
        self, app_label: str, schema_editor: Any, from_state: ProjectState, to_state: ProjectState
    ) -> None:
        model = to_state.apps.get_model(app_label, self.model_name)
        if self.allow_migrate_model(schema_editor.connection.alias, model) and self._applies(
            schema_editor
        ):
            self._add(model, schema_editor)

    def describe(self) -> str:
        return f"{super().describe()} without blocking writes{self._vendors_note()}"

    def reduce(self, operation: Any, app_label: str) -> Any:
        return False
