"""Review of issue 16: the non-blocking index operations and migration 0007.

What these tests show (django_idempotency/migration_operations.py,
migrations/0007_add_created_at_brin_index.py). Written failing where marked
"was FAILING"; the package was fixed after the review, and they pass now.

- was FAILING, fixed (the operations subclass ``IndexOperation``, not
  ``AddIndex``/``RemoveIndex``): ``squashmigrations`` folds an
  ``AddIndexWithoutBlocking`` into the ``CreateModel`` right before it.
  ``AddIndexWithoutBlocking.reduce()`` returning False only stops the
  optimizer when the index operation is the *earlier* one; the optimizer
  also asks the earlier ``CreateModel.reduce(AddIndex...)``, which takes any
  ``AddIndex`` subclass into ``Meta.indexes``: the index loses its
  ``vendors`` (every database is asked to build it).
  tests/test_migration_operations.py's writer test asserts
  ``brin.reduce(removal) is False`` as the proof that this never happens: it
  tests the other direction. (The package's own 0001..0007 are spared today
  only by RunPython operations in between: a passing test.)
- was FAILING, fixed (``pg_stat_progress_create_index`` consulted, the build
  waited for) (PostgreSQL): a concurrent build still IN PROGRESS in another
  session (a second ``migrate`` started by another pod of the same deploy)
  looks exactly like a failed build's leftover in ``pg_index``
  (``indisvalid`` false): the second run sets out to drop it, queues behind
  the first build, and then fails with PostgreSQL's internal error "tuple
  concurrently updated".
- passes (PostgreSQL): a session holding an old snapshot makes 0007 wait,
  with no bound, for as long as it stays open; it goes on once it ends.
  docs/upgrading.md said it "takes longer", not that an idle-in-transaction
  session (a worker cut off mid-transaction) holds it until the server ends
  that session, nor how to bound it (it says so now; the bound, a
  ``lock_timeout``, is tested in tests/test_migration_operations.py).
- passes: a router that keeps the app's records off an alias keeps 0007 off
  it too, and the migration is still recorded there.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.contrib.postgres.indexes import BrinIndex
from django.db import connection, connections, models
from django.db.migrations.executor import MigrationExecutor
from django.db.migrations.loader import MigrationLoader
from django.db.migrations.operations import CreateModel
from django.db.migrations.optimizer import MigrationOptimizer
from django.test import override_settings

from django_idempotency.migration_operations import AddIndexWithoutBlocking

APP = "django_idempotency"
TABLE = "django_idempotency_record"
BRIN = "idempotency_created_brin"
BEFORE = (APP, "0006_add_steps_and_tombstones")
AFTER = (APP, "0007_add_created_at_brin_index")
#: Bound on every wait for another thread or session to reach a state: only a hang gets near it.
HANG = 60.0


def _migrate_to(target: tuple[str, str]) -> None:
    MigrationExecutor(connection).migrate([target])


def _migrate_to_latest() -> None:
    executor = MigrationExecutor(connection)
    executor.migrate(executor.loader.graph.leaf_nodes(APP))


@pytest.fixture
def at_0006() -> Iterator[None]:
    _migrate_to(BEFORE)
    try:
        yield
    finally:
        _migrate_to_latest()


def _wait_until(condition: Any, what: str) -> None:
    deadline = time.monotonic() + HANG
    while not condition():
        assert time.monotonic() < deadline, f"waited {HANG} s for {what}"
        time.sleep(0.05)


# -- squashmigrations ---------------------------------------------------------------------


def test_squashing_the_packages_migrations_today_keeps_the_brin_index_apart() -> None:
    """What ``squashmigrations django_idempotency 0007`` would write, today.

    The squash command runs exactly this optimizer over the operations of
    0001..0007. The BRIN index stays a separate, vendor-restricted
    ``AddIndexWithoutBlocking`` here only because the operations of 0006
    that run code stand between it and ``CreateModel`` (see the next test).
    """
    loader = MigrationLoader(None, ignore_no_migrations=True)
    plan = loader.graph.forwards_plan(AFTER)
    operations = [
        operation
        for app_label, name in plan
        if app_label == APP
        for operation in loader.get_migration(app_label, name).operations
    ]
    squashed = MigrationOptimizer().optimize(operations, APP)

    assert not _folded_into_create_model(squashed, BRIN)
    kept = [op for op in squashed if isinstance(op, AddIndexWithoutBlocking)]
    assert [op.vendors for op in kept] == [("postgresql",)]


def _folded_into_create_model(operations: list[Any], index_name: str) -> bool:
    return any(
        isinstance(operation, CreateModel)
        and index_name in {index.name for index in operation.options.get("indexes", [])}
        for operation in operations
    )


def test_squashing_never_folds_a_vendor_restricted_index_into_create_model() -> None:
    """Was FAILING: the optimizer folded ``AddIndexWithoutBlocking`` into the ``CreateModel``.

    migration_operations.py said its ``reduce()`` returning False means
    "Never merged into a plain CreateModel/AddIndex by squashmigrations".
    But the optimizer asks the EARLIER operation, ``CreateModel.reduce()``,
    which takes any ``AddIndex`` subclass into ``Meta.indexes``: a later
    release's new table with a PostgreSQL-only index, squashed, would ask
    SQLite and MariaDB to build a BRIN index (a syntax error there) and put
    it in every database's model state.
    """
    created = CreateModel(
        "ReviewProbe",
        fields=[
            ("id", models.BigAutoField(primary_key=True)),
            ("created_at", models.DateTimeField()),
        ],
    )
    brin = AddIndexWithoutBlocking(
        "reviewprobe",
        BrinIndex(fields=["created_at"], name="review_probe_brin"),
        vendors=["postgresql"],
    )
    squashed = MigrationOptimizer().optimize([created, brin], APP)

    assert not _folded_into_create_model(squashed, "review_probe_brin"), (
        "the PostgreSQL-only index was folded into CreateModel's Meta.indexes"
    )
    assert squashed[-1] is brin


# -- PostgreSQL: builds and sessions --------------------------------------------------------


def _index_row(name: str) -> tuple[int, bool] | None:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT c.oid, i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
            "WHERE c.relname = %s",
            [name],
        )
        row = cursor.fetchone()
    return None if row is None else (int(row[0]), bool(row[1]))


def _waiting_backends(query_start: str) -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock' AND query ILIKE %s",
            [query_start + "%"],
        )
        return int(cursor.fetchone()[0])


class _OldSnapshot:
    """Another session with an open REPEATABLE READ snapshot: a long report, a pg_dump."""

    def __enter__(self) -> _OldSnapshot:
        self.other = connections.create_connection("default")
        self.other.set_autocommit(False)
        with self.other.cursor() as cursor:
            cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            cursor.execute(f"SELECT count(*) FROM {TABLE}")
        return self

    def __exit__(self, *exc: object) -> None:
        self.other.rollback()
        self.other.close()


def _in_a_thread(target: Any) -> tuple[threading.Thread, list[BaseException | None]]:
    done: list[BaseException | None] = []

    def run() -> None:
        try:
            target()
            done.append(None)
        except BaseException as exc:  # read by the test
            done.append(exc)
        finally:
            connections.close_all()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, done


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_build_in_progress_in_another_session_is_not_dropped_and_built_again(
    at_0006: None,
) -> None:
    """Two ``migrate`` runs at once (two pods of one deploy): the index is built once.

    The first build waits for an old snapshot, its index INVALID meanwhile.
    The second run must not take it for a failed build's leftover: at the
    review it did, waits on the first build's table lock, then drops the index the
    first build just finished and builds it again (on a large table: the
    whole build twice, and no index between the two).
    """
    with _OldSnapshot() as snapshot:
        first, first_done = _in_a_thread(lambda: _migrate_to(AFTER))
        _wait_until(lambda: _index_row(BRIN) is not None, "the first build to begin")
        in_progress = _index_row(BRIN)
        assert in_progress is not None and in_progress[1] is False  # looks like a leftover

        # The second run: the same operation, as its migrate would apply it
        # (0007 is not yet recorded: the first run has not finished).
        second, second_done = _in_a_thread(_apply_0007_again)
        # Give it the time to look at pg_index and queue behind the first build.
        _wait_until(
            lambda: _waiting_backends("") >= 2 or bool(second_done),
            "the second run to act",
        )
        snapshot.other.rollback()  # the report ends

        first.join(HANG)
        second.join(HANG)
    assert not first.is_alive() and not second.is_alive()
    assert first_done == [None]
    # Seen here: the second run's DROP INDEX CONCURRENTLY, queued behind the
    # first build, fails with PostgreSQL's "tuple concurrently updated" (an
    # InternalError) once that build ends: a failed deploy step whose message
    # says nothing useful. (Had the DROP won the race, the index just built
    # would be dropped and built again.)
    assert second_done == [None], f"the second migrate failed: {second_done[0]!r}"
    built = _index_row(BRIN)
    assert built is not None and built[1] is True
    assert built[0] == in_progress[0], (
        "the second run dropped the first run's build, in progress, as an invalid leftover, "
        "and built the index again"
    )


def _apply_0007_again() -> None:
    executor = MigrationExecutor(connection)
    migration = executor.loader.get_migration(*AFTER)
    state = executor.loader.project_state(BEFORE)
    with connection.schema_editor(atomic=False) as editor:
        migration.apply(state, editor)


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_0007_waits_without_bound_for_a_session_holding_an_old_snapshot(at_0006: None) -> None:
    """Behaviour to document: ``migrate`` waits as long as the oldest snapshot lives.

    An idle-in-transaction session (a worker cut off from the database in
    the middle of a transaction, issue 16's partition) keeps it until the
    server ends the session: TCP keepalive, ``idle_in_transaction_session_timeout``.
    """
    with _OldSnapshot() as snapshot:
        build, done = _in_a_thread(lambda: _migrate_to(AFTER))
        _wait_until(
            lambda: _waiting_backends("CREATE INDEX CONCURRENTLY") > 0,
            "the build to wait for the old snapshot",
        )
        time.sleep(2)  # not a timed assertion: it must simply still be waiting
        assert build.is_alive() and not done
        waiting = _index_row(BRIN)
        assert waiting is not None and waiting[1] is False
        snapshot.other.rollback()
        build.join(HANG)
    assert done == [None]
    built = _index_row(BRIN)
    assert built is not None and built[1] is True


# -- Routers ---------------------------------------------------------------------------------


class NoRecordsHereRouter:
    """The app's records live elsewhere: nothing of django_idempotency on this alias."""

    def allow_migrate(self, db: str, app_label: str, **hints: Any) -> bool | None:
        return False if app_label == APP else None


@pytest.mark.django_db(transaction=True)
def test_a_router_that_keeps_the_app_off_an_alias_keeps_0007_off_it(at_0006: None) -> None:
    try:
        with override_settings(DATABASE_ROUTERS=[f"{__name__}.NoRecordsHereRouter"]):
            _migrate_to(AFTER)
            with connection.cursor() as cursor:
                found = connection.introspection.get_constraints(cursor, TABLE)
            assert BRIN not in found
            applied = MigrationExecutor(connection).loader.applied_migrations
            assert AFTER in applied
    finally:
        # Back to 0006 without the router's say, then to the latest: the BRIN
        # index again where the other tests expect it.
        _migrate_to(BEFORE)
