"""Changing a large, busy table without blocking its writes: indexes and nullable columns.

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

An index still being built is INVALID too, until its build ends: another
``migrate`` of the same deploy (a second pod), or an operator's build by
hand. ``pg_stat_progress_create_index`` and ``pg_locks`` tell the two
apart. A build in progress is waited for (a warning names its backend),
then the index is kept if the build ended valid; only a leftover with no
build behind it is dropped. Dropping a build in progress would queue behind
it and then fail with PostgreSQL's "tuple concurrently updated", or throw
the whole build away. The wait takes the table's SHARE UPDATE EXCLUSIVE
lock for an instant, the lock the build holds to its end: writes go on,
``lock_timeout`` bounds it, and ``pg_blocking_pids`` names the build it
waits for. The build lets go of that lock just before its last
transaction, the one that marks the index valid, commits: a pg_index row
whose ``xmax`` is a transaction still open is waited for too. (Two builds
begun at the same instant, before either has made its index, deadlock in
PostgreSQL itself, one of them failing with "deadlock detected": migrate
again.)

``AddFieldWithoutBlocking`` adds a nullable column without a default,
which no database rewrites the table for: a change of the catalog only.
What it must still not do is wait in the table's lock queue. ``ALTER
TABLE`` needs the table's strongest lock for an instant, and waits for it
behind every transaction that has touched the table (a view's transaction,
open for as long as the view runs); every claim that comes after queues
behind the waiting ``ALTER``. So each attempt waits at most ``lock_wait``
(PostgreSQL's ``lock_timeout``, MySQL's and MariaDB's ``lock_wait_timeout``),
gives up, lets the queue drain and tries again, ``attempts`` times, then
fails naming what to look at. On MySQL and MariaDB the column is added
``ALGORITHM=INSTANT``, so that the server refuses rather than copies the
table should it ever not be able to; SQLite adds it with ``ALTER TABLE ADD
COLUMN`` (Django rebuilds the table only for a column that is not
nullable or has a default, and a rebuild would drop 0006's trigger).

The index operations subclass ``IndexOperation``, not ``AddIndex`` and
``RemoveIndex``: Django's ``CreateModel.reduce()`` takes any ``AddIndex``
into the new model's ``Meta.indexes``, and ``squashmigrations`` would then
build the index inside the table's creation, on every database (losing
``vendors``) and in a transaction. Django's squash also writes its
migration without ``atomic = False``: docs/upgrading.md says to add it.

``vendors`` restricts an index to some databases (a BRIN index exists only on
PostgreSQL). Django's model state is the same for every database, so such an
index cannot be one of the model's ``Meta.indexes`` (every other database
would be asked to create it): the operation then leaves the model state
alone and only changes the database, and ``makemigrations`` stays quiet on
all of them.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.db import OperationalError, models, transaction
from django.db.migrations.operations.base import OperationCategory
from django.db.migrations.operations.fields import AddField
from django.db.migrations.operations.models import IndexOperation
from django.db.migrations.state import ProjectState
from django.db.models.fields import NOT_PROVIDED

__all__ = ["AddFieldWithoutBlocking", "AddIndexWithoutBlocking", "RemoveIndexWithoutBlocking"]

#: Appended to MySQL's and MariaDB's CREATE INDEX: online, or an error.
_ONLINE = " ALGORITHM=INPLACE LOCK=NONE"

logger = logging.getLogger("django_idempotency")


class _WithoutBlocking:
    """What adding and removing share: the vendor filter and the transaction check."""

    index: models.Index
    model_name: str
    vendors: tuple[str, ...] | None

    def _applies(self, schema_editor: Any) -> bool:
        return self.vendors is None or schema_editor.connection.vendor in self.vendors

    def _change(
        self,
        change: Callable[[type[models.Model], Any], None],
        app_label: str,
        schema_editor: Any,
        state: ProjectState,
    ) -> None:
        """``change`` (add or remove) the index of ``state``'s model, where it applies."""
        model = state.apps.get_model(app_label, self.model_name)
        allowed = self.allow_migrate_model(schema_editor.connection.alias, model)  # type: ignore[attr-defined]
        if allowed and self._applies(schema_editor):
            change(model, schema_editor)

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
            if schema_editor.collect_sql:
                schema_editor.add_index(model, self.index, concurrently=True)
            else:
                self._add_concurrently(model, schema_editor)
        elif vendor == "mysql":
            if self.index.contains_expressions and not (
                schema_editor.connection.features.supports_expression_indexes
            ):
                return  # as Django's add_index() does
            # params=None, as Django's add_index(): with () the driver would
            # %-format the statement, and an expression or a name with "%" breaks.
            schema_editor.execute(
                f"{self.index.create_sql(model, schema_editor)}{_ONLINE}", params=None
            )
        else:
            schema_editor.add_index(model, self.index)

    def _add_concurrently(self, model: type[models.Model], schema_editor: Any) -> None:
        found = self._settled_index(schema_editor, model._meta.db_table)
        if found is not None and found.valid:
            return  # built by hand beforehand, or by another session's build just waited for
        if found is not None:
            # A failed build's leftover: nobody builds it, nobody updates it.
            schema_editor.remove_index(model, self.index, concurrently=True)
        schema_editor.add_index(model, self.index, concurrently=True)

    def _settled_index(self, schema_editor: Any, table: str) -> _IndexState | None:
        """The index of this name once no other session is building it; None: there is none."""
        name, waited = self.index.name, False
        while True:
            found = _index_state(schema_editor, table, name)
            if found is None or found.valid:
                return found
            if found.builder is not None:
                logger.warning(
                    "The index %s is invalid and another session (PostgreSQL backend %s) is "
                    "building it, or holds its table (another migrate, a build by hand, a "
                    "VACUUM): waiting for it to end before dropping or keeping the index. "
                    "pg_stat_progress_create_index shows how far a build is; "
                    "pg_blocking_pids() names what this session waits for.",
                    name,
                    found.builder,
                )
                # A build holds SHARE UPDATE EXCLUSIVE on the table until it
                # ends; taking it (for an instant) waits for exactly that.
                # Writes do not conflict with it.
                quoted = schema_editor.quote_name(table)
                with transaction.atomic(using=schema_editor.connection.alias):
                    schema_editor.execute(f"LOCK TABLE {quoted} IN SHARE UPDATE EXCLUSIVE MODE")
                waited = True
            elif found.updating:
                # A build lets go of the table (and of its progress row) just
                # before its last transaction, the one that marks the index
                # valid, commits: a moment.
                time.sleep(0.05)
            else:
                if waited:
                    logger.warning(
                        "The index %s is still invalid after the other session ended: its "
                        "build failed; the index is dropped and built again.",
                        name,
                    )
                return found

    def _remove(self, model: type[models.Model], schema_editor: Any) -> None:
        if schema_editor.connection.vendor == "postgresql":
            self._outside_a_transaction(schema_editor)
            # DROP INDEX CONCURRENTLY IF EXISTS: a build that never finished is gone too.
            schema_editor.remove_index(model, self.index, concurrently=True)
        else:
            schema_editor.remove_index(model, self.index)

    def _vendors_note(self) -> str:
        return f" (on {', '.join(self.vendors)} only)" if self.vendors else ""


@dataclass(frozen=True)
class _IndexState:
    """An index of the name in ``pg_index``, and whether another session is at it."""

    valid: bool
    #: The backend building it (CREATE INDEX CONCURRENTLY), or holding its
    #: table's SHARE UPDATE EXCLUSIVE lock; None: nobody.
    builder: int | None
    #: Its pg_index row is being updated by a transaction still open: a
    #: build's last one, marking it valid, about to commit.
    updating: bool


#: The index's validity, and who is at it. The progress view names a build,
#: but shows another role's without its index (unless the role may read all
#: statistics); pg_locks shows every role's locks: a session holding the
#: table's SHARE UPDATE EXCLUSIVE lock may be that build (or a VACUUM, which
#: the DROP would have to wait for anyway), and the transaction lock of the
#: pg_index row's xmax, a transaction updating the row.
_INDEX_STATE = (
    "SELECT i.indisvalid, COALESCE("
    "(SELECT p.pid FROM pg_stat_progress_create_index p "
    "WHERE p.index_relid = i.indexrelid AND p.pid <> pg_backend_pid() LIMIT 1), "
    "(SELECT l.pid FROM pg_locks l WHERE l.locktype = 'relation' AND l.relation = i.indrelid "
    "AND l.database = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database()) "
    "AND l.mode = 'ShareUpdateExclusiveLock' AND l.granted AND l.pid <> pg_backend_pid() "
    "LIMIT 1)), "
    "EXISTS (SELECT 1 FROM pg_locks t WHERE t.locktype = 'transactionid' "
    "AND t.transactionid = i.xmax AND t.pid <> pg_backend_pid()) "
    "FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
    "WHERE c.relname = %s AND i.indrelid = to_regclass(%s)"
)


def _index_state(schema_editor: Any, table: str, name: str) -> _IndexState | None:
    """The index ``name`` on ``table``; None when there is none."""
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(_INDEX_STATE, [name, schema_editor.quote_name(table)])
        row = cursor.fetchone()
    if row is None:
        return None
    return _IndexState(
        valid=bool(row[0]), builder=None if row[1] is None else int(row[1]), updating=bool(row[2])
    )


class AddIndexWithoutBlocking(_WithoutBlocking, IndexOperation):
    """``AddIndex`` that lets writes go on meanwhile; its migration needs ``atomic = False``.

    Args:
        model_name: As for ``AddIndex``.
        index: As for ``AddIndex``.
        vendors: The databases (``connection.vendor``) that get the index;
            None for all. When given, the model state is left alone: the
            index is not one of the model's ``Meta.indexes``.
    """

    category = OperationCategory.ADDITION

    def __init__(
        self, model_name: str, index: models.Index, vendors: Iterable[str] | None = None
    ) -> None:
        if not index.name:
            raise ValueError(f"{type(self).__name__} needs a named index; {index!r} has none.")
        self.model_name = model_name
        self.index = index
        self.vendors = tuple(vendors) if vendors is not None else None

    def deconstruct(self) -> tuple[str, Sequence[Any], dict[str, Any]]:
        kwargs: dict[str, Any] = {"model_name": self.model_name, "index": self.index}
        if self.vendors is not None:
            kwargs["vendors"] = list(self.vendors)
        return type(self).__qualname__, [], kwargs

    def state_forwards(self, app_label: str, state: ProjectState) -> None:
        if self.vendors is None:
            state.add_index(app_label, self.model_name_lower, self.index)

    def database_forwards(
        self, app_label: str, schema_editor: Any, from_state: ProjectState, to_state: ProjectState
    ) -> None:
        self._change(self._add, app_label, schema_editor, to_state)

    def database_backwards(
        self, app_label: str, schema_editor: Any, from_state: ProjectState, to_state: ProjectState
    ) -> None:
        self._change(self._remove, app_label, schema_editor, from_state)

    def describe(self) -> str:
        if self.index.expressions:
            what = f"on {', '.join(str(expression) for expression in self.index.expressions)}"
        else:
            what = f"on field(s) {', '.join(self.index.fields)}"
        return (
            f"Create index {self.index.name} {what} of model {self.model_name} "
            f"without blocking writes{self._vendors_note()}"
        )

    @property
    def migration_name_fragment(self) -> str:
        return f"{self.model_name_lower}_{self.index.name.lower()}"

    def reduce(self, operation: Any, app_label: str) -> Any:
        # Never merged with another operation, nor moved across one, by
        # squashmigrations: that could lose the concurrency or the vendors.
        # (Not an AddIndex subclass, so CreateModel.reduce() leaves it alone too.)
        return False


class RemoveIndexWithoutBlocking(_WithoutBlocking, IndexOperation):
    """``RemoveIndex`` that lets writes go on meanwhile (``DROP INDEX CONCURRENTLY``).

    Args:
        model_name: As for ``RemoveIndex``.
        index: The index as it was added (``RemoveIndex`` takes only its
            name, and reads the rest from the model state, where an index
            restricted to some ``vendors`` never was).
        vendors: As for ``AddIndexWithoutBlocking``.
    """

    category = OperationCategory.REMOVAL

    def __init__(
        self, model_name: str, index: models.Index, vendors: Iterable[str] | None = None
    ) -> None:
        self.model_name = model_name
        self.index = index
        self.vendors = tuple(vendors) if vendors is not None else None

    @property
    def name(self) -> str:
        """The index's name, as ``RemoveIndex`` has it."""
        return str(self.index.name)

    def deconstruct(self) -> tuple[str, Sequence[Any], dict[str, Any]]:
        kwargs: dict[str, Any] = {"model_name": self.model_name, "index": self.index}
        if self.vendors is not None:
            kwargs["vendors"] = list(self.vendors)
        return type(self).__qualname__, [], kwargs

    def state_forwards(self, app_label: str, state: ProjectState) -> None:
        if self.vendors is None:
            state.remove_index(app_label, self.model_name_lower, self.index.name)

    def database_forwards(
        self, app_label: str, schema_editor: Any, from_state: ProjectState, to_state: ProjectState
    ) -> None:
        self._change(self._remove, app_label, schema_editor, from_state)

    def database_backwards(
        self, app_label: str, schema_editor: Any, from_state: ProjectState, to_state: ProjectState
    ) -> None:
        self._change(self._add, app_label, schema_editor, to_state)

    def describe(self) -> str:
        return (
            f"Remove index {self.index.name} from {self.model_name} "
            f"without blocking writes{self._vendors_note()}"
        )

    @property
    def migration_name_fragment(self) -> str:
        return f"remove_{self.model_name_lower}_{self.index.name.lower()}"

    def reduce(self, operation: Any, app_label: str) -> Any:
        return False


class AddFieldWithoutBlocking(AddField):
    """``AddField`` of a nullable column without a default, its wait for the table bounded.

    Each attempt at the ``ALTER TABLE`` waits at most ``lock_wait`` for the
    table's lock (claims queue behind a waiting ``ALTER`` no longer than
    that); ``attempts`` attempts, with a growing pause between them, then
    an error. Going back drops the column the same way.

    Args:
        model_name: As for ``AddField``.
        name: As for ``AddField``.
        field: A nullable field with neither ``default`` nor ``db_default``,
            not unique, not indexed and no relation: what every supported
            database adds without touching the table's rows.
        preserve_default: As for ``AddField``.

    Raises:
        ValueError: ``field`` is none of those: use ``AddField``, and see
            docs/upgrading.md for what it costs a busy table.
    """

    #: How long one attempt waits for the table's lock.
    lock_wait = timedelta(seconds=1)
    attempts = 30
    #: The pause after the n-th failed attempt is n times this, at most ``_LONGEST_PAUSE``.
    pause = 0.2

    def __init__(
        self,
        model_name: str,
        name: str,
        field: models.Field[Any, Any],
        preserve_default: bool = True,
    ) -> None:
        problem = _why_not_catalog_only(field)
        if problem:
            raise ValueError(
                f"{type(self).__name__}({model_name!r}, {name!r}) adds only a nullable column "
                f"without a default, which no database rewrites the table for; this field "
                f"{problem}. Use AddField (docs/upgrading.md says what it costs a busy table)."
            )
        super().__init__(model_name, name, field, preserve_default)

    def database_forwards(
        self, app_label: str, schema_editor: Any, from_state: ProjectState, to_state: ProjectState
    ) -> None:
        to_model = to_state.apps.get_model(app_label, self.model_name)
        if not self.allow_migrate_model(schema_editor.connection.alias, to_model):
            return
        from_model = from_state.apps.get_model(app_label, self.model_name)
        field = to_model._meta.get_field(self.name)
        self._bounded(schema_editor, lambda: _add_column(schema_editor, from_model, field))

    def database_backwards(
        self, app_label: str, schema_editor: Any, from_state: ProjectState, to_state: ProjectState
    ) -> None:
        from_model = from_state.apps.get_model(app_label, self.model_name)
        if not self.allow_migrate_model(schema_editor.connection.alias, from_model):
            return
        field = from_model._meta.get_field(self.name)
        self._bounded(schema_editor, lambda: schema_editor.remove_field(from_model, field))

    def describe(self) -> str:
        return f"Add field {self.name} to {self.model_name} without queueing writes behind it"

    def _bounded(self, schema_editor: Any, change: Callable[[], None]) -> None:
        connection = schema_editor.connection
        if schema_editor.collect_sql or connection.vendor not in _LOCK_WAITS:
            change()  # sqlmigrate prints the change itself; SQLite has no lock queue
            return
        for attempt in range(1, self.attempts + 1):
            try:
                with _LOCK_WAITS[connection.vendor](connection, self.lock_wait):
                    change()
                return
            except OperationalError as exc:
                if not _ran_out_of_lock_wait(exc, connection.vendor):
                    raise
                if attempt == self.attempts:
                    raise OperationalError(
                        f"{self.describe()}: the table's lock was not free within "
                        f"{self.lock_wait.total_seconds():g} s in any of {self.attempts} "
                        "attempts. A long transaction holds the table (PostgreSQL: "
                        "pg_stat_activity, pg_locks; MySQL/MariaDB: SHOW PROCESSLIST, "
                        "information_schema.innodb_trx); migrate again once it ended."
                    ) from exc
                logger.warning(
                    "%s: the table's lock was not free within %g s (attempt %d of %d): "
                    "a transaction holds the table; trying again.",
                    self.describe(),
                    self.lock_wait.total_seconds(),
                    attempt,
                    self.attempts,
                )
                time.sleep(min(self.pause * attempt, _LONGEST_PAUSE))


_LONGEST_PAUSE = 5.0


def _why_not_catalog_only(field: models.Field[Any, Any]) -> str:
    if not field.null:
        return "is not nullable"
    if field.has_default() or field.db_default is not NOT_PROVIDED:
        return "has a default"
    if field.unique or field.primary_key or getattr(field, "db_index", False):
        return "is unique or indexed"
    if field.is_relation:
        return "is a relation"
    return ""


def _add_column(schema_editor: Any, model: type[models.Model], field: Any) -> None:
    if schema_editor.connection.vendor != "mysql":
        schema_editor.add_field(model, field)
        return
    definition, params = schema_editor.column_sql(model, field, include_default=False)
    statement = schema_editor.sql_create_column % {
        "table": schema_editor.quote_name(model._meta.db_table),
        "column": schema_editor.quote_name(field.column),
        "definition": definition,
    }
    # params=None unless there are some: with () the driver would %-format it.
    schema_editor.execute(f"{statement}, ALGORITHM=INSTANT", params=params or None)


@contextmanager
def _postgresql_lock_wait(connection: Any, wait: timedelta) -> Iterator[None]:
    # A savepoint in the migration's transaction (or a transaction of its
    # own): a timed-out ALTER rolls back to it, leaving the rest intact. The
    # setting is the transaction's, so it is put back for what follows.
    with transaction.atomic(using=connection.alias), connection.cursor() as cursor:
        cursor.execute("SELECT current_setting('lock_timeout')")
        (before,) = cursor.fetchone()
        cursor.execute(
            "SELECT set_config('lock_timeout', %s, true)",
            [str(max(1, round(wait.total_seconds() * 1000)))],
        )
        yield
        cursor.execute("SELECT set_config('lock_timeout', %s, true)", [before])


@contextmanager
def _mysql_lock_wait(connection: Any, wait: timedelta) -> Iterator[None]:
    # Whole seconds, at least one; the session's own value is put back after.
    with connection.cursor() as cursor:
        cursor.execute("SELECT @@SESSION.lock_wait_timeout")
        (before,) = cursor.fetchone()
        cursor.execute(
            "SET SESSION lock_wait_timeout = %s", [max(1, math.ceil(wait.total_seconds()))]
        )
        try:
            yield
        finally:
            cursor.execute("SET SESSION lock_wait_timeout = %s", [before])


_LOCK_WAITS: dict[str, Callable[[Any, timedelta], Any]] = {
    "postgresql": _postgresql_lock_wait,
    "mysql": _mysql_lock_wait,
}

#: PostgreSQL's lock_not_available; MySQL's and MariaDB's ER_LOCK_WAIT_TIMEOUT.
_LOCK_NOT_AVAILABLE = "55P03"
_LOCK_WAIT_TIMEOUT = 1205


def _ran_out_of_lock_wait(exc: OperationalError, vendor: str) -> bool:
    if vendor == "mysql":
        return bool(exc.args and exc.args[0] == _LOCK_WAIT_TIMEOUT)
    cause = exc.__cause__  # psycopg's error: sqlstate (psycopg 3), pgcode (psycopg2)
    return _LOCK_NOT_AVAILABLE in (getattr(cause, "sqlstate", None), getattr(cause, "pgcode", None))
