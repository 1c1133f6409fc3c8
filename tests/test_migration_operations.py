"""Indexes added and removed without blocking writes, on every supported database.

``AddIndexWithoutBlocking`` and ``RemoveIndexWithoutBlocking``
(``django_idempotency/migration_operations.py``) and migration 0007 that
uses them, in the suite's database of each pass:

- 0007 leaves the BRIN index on ``created_at`` on PostgreSQL, and no index
  on MySQL/MariaDB or SQLite; ``makemigrations --check`` stays quiet on all
  of them (tests/test_packaging.py), since the index is not in the model
  state;
- the SQL each database gets: ``CREATE INDEX CONCURRENTLY`` on PostgreSQL,
  ``ALGORITHM=INPLACE LOCK=NONE`` on MySQL/MariaDB, a plain ``CREATE INDEX``
  on SQLite (``sqlmigrate``, and a generic index added and removed for real);
- on PostgreSQL: inside a transaction the operation refuses with a message
  that names ``atomic = False``; an INVALID index left by a failed
  concurrent build is dropped and built again; a valid one an operator
  built by hand beforehand is kept; two builds begun at the same instant
  (PostgreSQL's deadlock) leave a valid index after one more run; a
  ``lock_timeout`` makes a build stuck behind an old snapshot fail, and the
  next migrate cleans up its leftover; a leftover whose table another
  session holds (as a build does) is dropped only once it lets go (a build
  still in progress in another session is waited for, not dropped:
  test_a_build_in_progress_in_another_session_is_not_dropped_and_built_again);
- the CREATE INDEX is not %-formatted: a name with "%" is added on every database;
- on MariaDB: rows are inserted while the online build runs.

tests/live/test_index_build_without_blocking.py shows claims going on
through gunicorn while 0007 builds on 1.5 million records.

``AddFieldWithoutBlocking`` and migration 0008 that uses it: the digest
columns are added and dropped on every database (on SQLite without a
rebuild that would drop 0006's trigger, on MySQL/MariaDB
``ALGORITHM=INSTANT``); a field that would make a database touch the rows
is refused; on PostgreSQL and MariaDB a claim goes on while the ``ALTER
TABLE`` waits for a transaction that holds the table, and a table held
past every attempt fails the migration with a message, nothing changed.
"""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.contrib.postgres.indexes import BrinIndex
from django.core.management import call_command
from django.db import connection, connections, models, transaction
from django.db.migrations.executor import MigrationExecutor
from django.db.migrations.loader import MigrationLoader
from django.db.migrations.operations import CreateModel
from django.db.migrations.optimizer import MigrationOptimizer
from django.db.migrations.state import ProjectState
from django.db.migrations.writer import MigrationWriter
from django.db.models.functions import Lower
from django.test import override_settings
from django.utils import timezone

from django_idempotency.migration_operations import (
    AddFieldWithoutBlocking,
    AddIndexWithoutBlocking,
    RemoveIndexWithoutBlocking,
)
from django_idempotency.models import IdempotencyRecord

APP = "django_idempotency"
TABLE = "django_idempotency_record"
BRIN = "idempotency_created_brin"
BEFORE = (APP, "0006_add_steps_and_tombstones")
AFTER = (APP, "0007_add_created_at_brin_index")
DIGESTS = (APP, "0008_add_principal_and_credential_digests")
DIGEST_COLUMNS = {"principal_digest", "credential_digest"}
#: A generic index, on every database: what a later migration of the package would add.
UPDATED = models.Index(fields=["updated_at"], name="idempotency_updated_test")


def indexes() -> dict[str, Any]:
    with connection.cursor() as cursor:
        found = connection.introspection.get_constraints(cursor, TABLE)
    return {name: info for name, info in found.items() if info["index"]}


def migrate_to(target: tuple[str, str]) -> None:
    executor = MigrationExecutor(connection)
    executor.migrate([target])


@pytest.fixture
def at_0006() -> Iterator[None]:
    """The records table as 0006 left it; migrated to the latest again afterwards."""
    migrate_to(BEFORE)
    try:
        yield
    finally:
        executor = MigrationExecutor(connection)
        executor.migrate(executor.loader.graph.leaf_nodes(APP))


def state() -> ProjectState:
    return MigrationExecutor(connection).loader.project_state()


def apply(operation: Any, *, backwards: bool = False) -> None:
    before = state()
    after = before.clone()
    operation.state_forwards(APP, after)
    with connection.schema_editor(atomic=False) as editor:
        if backwards:
            operation.database_backwards(APP, editor, after, before)
        else:
            operation.database_forwards(APP, editor, before, after)


def collected_sql(operation: Any) -> str:
    before = state()
    after = before.clone()
    operation.state_forwards(APP, after)
    with connection.schema_editor(collect_sql=True, atomic=False) as editor:
        operation.database_forwards(APP, editor, before, after)
    return "\n".join(editor.collected_sql)


@pytest.mark.django_db(transaction=True)
def test_0007_leaves_a_brin_index_on_postgresql_only() -> None:
    found = indexes()
    if connection.vendor == "postgresql":
        assert found[BRIN]["columns"] == ["created_at"]
        assert found[BRIN]["type"] == "brin"
    else:
        assert BRIN not in found
    # Not in the model state: makemigrations has nothing to say on any database.
    assert BRIN not in {index.name for index in IdempotencyRecord._meta.indexes}


@pytest.mark.django_db(transaction=True)
def test_0007_migrates_back_and_forth(at_0006: None) -> None:
    assert BRIN not in indexes()
    migrate_to(AFTER)
    assert (BRIN in indexes()) == (connection.vendor == "postgresql")


@pytest.mark.django_db(transaction=True)
def test_sqlmigrate_shows_what_each_database_runs() -> None:
    out = io.StringIO()
    call_command("sqlmigrate", APP, "0007", stdout=out)
    printed = out.getvalue()
    if connection.vendor == "postgresql":
        assert (
            f'CREATE INDEX CONCURRENTLY "{BRIN}" ON "{TABLE}" USING brin ("created_at") '
            "WITH (autosummarize = on);"
        ) in printed
        assert "BEGIN;" not in printed  # not atomic
    else:
        assert "(no-op)" in printed

    generic = collected_sql(AddIndexWithoutBlocking("idempotencyrecord", UPDATED))
    if connection.vendor == "postgresql":
        assert generic.startswith('CREATE INDEX CONCURRENTLY "idempotency_updated_test"')
    elif connection.vendor == "mysql":
        assert generic.startswith("CREATE INDEX `idempotency_updated_test`")
        assert generic.endswith("ALGORITHM=INPLACE LOCK=NONE;")
    else:
        assert generic.startswith('CREATE INDEX "idempotency_updated_test"')


@pytest.mark.django_db(transaction=True)
def test_a_generic_index_is_added_and_removed_on_every_database() -> None:
    adding = AddIndexWithoutBlocking("idempotencyrecord", UPDATED)
    try:
        apply(adding)
        assert indexes()[UPDATED.name]["columns"] == ["updated_at"]
        # In the model state, unlike an index restricted to some vendors.
        after = state().clone()
        adding.state_forwards(APP, after)
        assert UPDATED.name in {
            index.name for index in after.models[APP, "idempotencyrecord"].options["indexes"]
        }
        removing = RemoveIndexWithoutBlocking("idempotencyrecord", UPDATED)
        apply(removing)
        assert UPDATED.name not in indexes()
        apply(removing, backwards=True)
        assert UPDATED.name in indexes()
        apply(adding, backwards=True)
        assert UPDATED.name not in indexes()
    finally:
        with connection.cursor() as cursor:
            if UPDATED.name in indexes():
                on = f" ON {TABLE}" if connection.vendor == "mysql" else ""
                cursor.execute(f"DROP INDEX {UPDATED.name}{on}")


def test_the_operations_are_written_and_read_back_by_djangos_migration_writer() -> None:
    brin = AddIndexWithoutBlocking("idempotencyrecord", UPDATED, vendors=["postgresql"])
    removal = RemoveIndexWithoutBlocking("idempotencyrecord", UPDATED, vendors=["postgresql"])
    for operation in (brin, removal):
        text, imports = MigrationWriter.serialize(operation)
        assert "vendors=['postgresql']" in text
        assert "import django_idempotency.migration_operations" in imports
        name, args, kwargs = operation.deconstruct()
        rebuilt = type(operation)(*args, **kwargs)
        assert rebuilt.deconstruct() == (name, args, kwargs)
    assert brin.describe().endswith("without blocking writes (on postgresql only)")
    assert removal.describe().endswith("without blocking writes (on postgresql only)")
    # Never merged with each other by squashmigrations (nor with anything
    # else: reduce() is False for every operation). That they are not folded
    # into a CreateModel before them is CreateModel.reduce()'s side:
    # test_squashing_never_folds_a_vendor_restricted_index_into_create_model
    # squashes one for real.
    assert brin.reduce(removal, APP) is False
    assert removal.reduce(brin, APP) is False


@pytest.mark.django_db(transaction=True)
def test_an_index_whose_sql_holds_a_percent_sign_is_added() -> None:
    """The CREATE INDEX is not %-formatted, as in Django's own ``add_index()`` (params=None).

    Given params=() MySQLdb %-formats the statement: "%" in an expression
    (MySQL 8) or a name fails. (Removal goes through Django's
    ``remove_index()``, which formats on every database: not the operation's
    to change.)
    """
    percent = models.Index(fields=["updated_at"], name="idempotency_pct%_test")
    try:
        # Out of the model state (vendors): Django %-formats the names of Meta.indexes.
        apply(AddIndexWithoutBlocking("idempotencyrecord", percent, vendors=[connection.vendor]))
        assert indexes()[percent.name]["columns"] == ["updated_at"]
    finally:
        if percent.name in indexes():
            on = f" ON {TABLE}" if connection.vendor == "mysql" else ""
            with connection.cursor() as cursor:
                cursor.execute(f"DROP INDEX {connection.ops.quote_name(percent.name)}{on}", None)


@pytest.mark.django_db(transaction=True)
def test_an_expression_index_is_left_out_where_the_database_has_none() -> None:
    lowered = models.Index(Lower("key"), name="idempotency_lower_key_test")
    try:
        apply(AddIndexWithoutBlocking("idempotencyrecord", lowered))
        supported = connection.features.supports_expression_indexes
        assert (lowered.name in indexes()) == supported  # MariaDB has none: as AddIndex
    finally:
        apply(RemoveIndexWithoutBlocking("idempotencyrecord", lowered))
    assert lowered.name not in indexes()


# -- PostgreSQL: transactions, failed builds, indexes built by hand -----------------------


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_inside_a_transaction_the_operation_says_to_make_the_migration_non_atomic() -> None:
    before = state()
    with (
        transaction.atomic(),
        connection.schema_editor() as editor,
        pytest.raises(NotImplementedError, match="atomic = False"),
    ):
        AddIndexWithoutBlocking("idempotencyrecord", UPDATED).database_forwards(
            APP, editor, before, before.clone()
        )
    assert UPDATED.name not in indexes()


def index_row(name: str) -> tuple[Any, ...] | None:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT c.oid, am.amname, i.indisvalid FROM pg_index i "
            "JOIN pg_class c ON c.oid = i.indexrelid JOIN pg_am am ON am.oid = c.relam "
            "WHERE c.relname = %s",
            [name],
        )
        row: tuple[Any, ...] | None = cursor.fetchone()
        return row


def insert_record_as_0006_has_it(key: str, state: str, *, created_at: datetime) -> None:
    """A record with only the columns 0006 has (the model's include those 0008 adds)."""
    names = ("tenant", "operation", "key", "fingerprint", "state", "created_at", "updated_at",
             "expires_at")  # fmt: skip
    quoted = ", ".join(connection.ops.quote_name(name) for name in names)
    values: list[Any] = [
        "t", "op", key, "f", state, created_at, created_at, created_at + timedelta(days=1)
    ]  # fmt: skip
    quote = connection.ops.quote_name
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {TABLE} ({quoted}, {quote('lease_owner')}, {quote('fencing_token')}, "
            f"{quote('provider_key')}, {quote('provider_operation_id')}, "
            f"{quote('response_headers')}) "
            f"VALUES ({', '.join(['%s'] * len(names))}, '', 1, '', '', '[]')",
            values,
        )


def leave_a_failed_build() -> tuple[Any, ...]:
    """A concurrent build of the BRIN's name that fails half way: a unique index over duplicates."""
    now = timezone.now()
    for key in ("one", "two"):
        insert_record_as_0006_has_it(key, "COMPLETED", created_at=now)
    with (
        pytest.raises(Exception, match="could not create unique index"),
        connection.cursor() as cursor,
    ):
        cursor.execute(f'CREATE UNIQUE INDEX CONCURRENTLY "{BRIN}" ON {TABLE} (created_at)')
    left = index_row(BRIN)
    assert left is not None and left[1:] == ("btree", False)  # INVALID, in the way
    return left


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_an_invalid_index_left_by_a_failed_concurrent_build_is_dropped_and_built_again(
    at_0006: None,
) -> None:
    left = leave_a_failed_build()

    migrate_to(AFTER)

    rebuilt = index_row(BRIN)
    assert rebuilt is not None and rebuilt[1:] == ("brin", True)
    assert rebuilt[0] != left[0]


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_leftover_whose_table_another_session_holds_is_dropped_once_it_lets_go(
    at_0006: None,
) -> None:
    """Another session holds the table's SHARE UPDATE EXCLUSIVE lock, the lock a build holds.

    Another role's build shows no index in ``pg_stat_progress_create_index``,
    only this lock (a VACUUM holds it too): the operation waits for it
    instead of taking the invalid index for a leftover at once, then, the
    index still invalid and nobody left holding the table, drops it and
    builds it again.
    """
    left = leave_a_failed_build()
    holder = connections.create_connection("default")
    done: list[BaseException | None] = []

    def migrate() -> None:
        try:
            migrate_to(AFTER)
            done.append(None)
        except BaseException as exc:  # read by the test
            done.append(exc)
        finally:
            connections.close_all()

    migrating = threading.Thread(target=migrate, daemon=True)
    try:
        holder.set_autocommit(False)
        with holder.cursor() as cursor:
            cursor.execute(f"LOCK TABLE {TABLE} IN SHARE UPDATE EXCLUSIVE MODE")
        migrating.start()
        deadline = time.monotonic() + 60
        while waiting_statements("LOCK TABLE") < 1:
            assert time.monotonic() < deadline and not done, f"migrate never waited: {done}"
            time.sleep(0.05)
        assert index_row(BRIN) == left  # not dropped while the table is held
        holder.rollback()
        migrating.join(60)
    finally:
        holder.rollback()
        holder.close()
        migrating.join(60)
    assert done == [None], done
    rebuilt = index_row(BRIN)
    assert rebuilt is not None and rebuilt[1:] == ("brin", True)
    assert rebuilt[0] != left[0]


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_valid_index_built_by_hand_beforehand_is_kept(at_0006: None) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            f'CREATE INDEX CONCURRENTLY "{BRIN}" ON {TABLE} USING brin (created_at) '
            "WITH (autosummarize = on)"
        )
    built = index_row(BRIN)

    migrate_to(AFTER)

    assert index_row(BRIN) == built


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_two_builds_begun_at_the_same_instant_leave_the_index_to_the_next_migrate(
    at_0006: None,
) -> None:
    """Two ``migrate`` runs that both found no index: PostgreSQL's deadlock, then one more run.

    A third session holds the table's SHARE UPDATE EXCLUSIVE lock (a VACUUM,
    say), so both CREATE INDEX CONCURRENTLY wait for it, having both seen no
    index. Two concurrent builds on one table deadlock in PostgreSQL itself
    (each waits for the other's snapshot or lock): one of them fails with
    "deadlock detected". Documented (docs/upgrading.md): run migrate again,
    which keeps a valid index, or drops an invalid leftover and builds it.
    (A run that finds the other's build already under way waits for it
    instead: test_a_build_in_progress_in_another_session_is_not_dropped_and_built_again.)
    """
    other = connections.create_connection("default")
    results: list[BaseException | None] = []

    def build() -> None:
        try:
            apply(AddIndexWithoutBlocking("idempotencyrecord", UPDATED))
            results.append(None)
        except BaseException as exc:  # read by the test
            results.append(exc)
        finally:
            connections.close_all()

    builders = [threading.Thread(target=build, daemon=True) for _ in range(2)]
    try:
        other.set_autocommit(False)
        with other.cursor() as cursor:
            cursor.execute(f"LOCK TABLE {TABLE} IN SHARE UPDATE EXCLUSIVE MODE")
        for builder in builders:
            builder.start()
        deadline = time.monotonic() + 60
        while waiting_statements("CREATE INDEX CONCURRENTLY") < 2:
            assert time.monotonic() < deadline, f"both builds never waited: {results}"
            time.sleep(0.05)
        other.rollback()
        for builder in builders:
            builder.join(60)
        assert len(results) == 2 and results.count(None) >= 1, results
        for failure in filter(None, results):
            assert "deadlock detected" in str(failure), results

        apply(AddIndexWithoutBlocking("idempotencyrecord", UPDATED))  # the next migrate

        row = index_row(UPDATED.name)
        assert row is not None and row[1:] == ("btree", True)
    finally:
        other.rollback()
        other.close()
        for builder in builders:
            builder.join(60)
        with connection.cursor() as cursor:
            cursor.execute(f"DROP INDEX IF EXISTS {UPDATED.name}")


def waiting_statements(query_start: str) -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock' AND query ILIKE %s",
            [query_start + "%"],
        )
        return int(cursor.fetchone()[0])


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_lock_timeout_makes_the_build_fail_and_the_next_migrate_cleans_up(
    at_0006: None,
) -> None:
    """What docs/upgrading.md advises against a build that waits without end.

    A session keeps an old snapshot open (a worker cut off mid-transaction):
    CREATE INDEX CONCURRENTLY waits for it with no bound. With
    ``lock_timeout`` set for the migrate session, the build fails instead,
    leaving an invalid index; the next migrate drops it and builds again.
    """
    snapshot = connections.create_connection("default")
    try:
        snapshot.set_autocommit(False)
        with snapshot.cursor() as cursor:
            cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            cursor.execute(f"SELECT count(*) FROM {TABLE}")
        with connection.cursor() as cursor:
            cursor.execute("SET lock_timeout = '1s'")
        try:
            with pytest.raises(Exception, match="lock timeout"):
                migrate_to(AFTER)
        finally:
            with connection.cursor() as cursor:
                cursor.execute("RESET lock_timeout")
        left = index_row(BRIN)
        assert left is not None and left[1:] == ("brin", False)  # the failed build's leftover
        assert AFTER not in MigrationExecutor(connection).loader.applied_migrations
    finally:
        snapshot.rollback()
        snapshot.close()

    migrate_to(AFTER)

    rebuilt = index_row(BRIN)
    assert rebuilt is not None and rebuilt[1:] == ("brin", True)
    assert rebuilt[0] != left[0]


# -- MariaDB: the online build --------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_on_mariadb_rows_are_inserted_while_the_index_is_built() -> None:
    if not getattr(connection, "mysql_is_mariadb", False):
        pytest.skip("MariaDB's online index build (its sequence engine fills the table)")
    with connection.cursor() as cursor:
        # Enough rows for the build to last a moment (MariaDB's sequence engine).
        cursor.execute(
            f"INSERT INTO {TABLE} (tenant, operation, `key`, fingerprint, state, lease_owner, "
            "fencing_token, provider_key, provider_operation_id, response_headers, "
            "response_sealed, created_at, updated_at, expires_at, tombstone) "
            "SELECT 't', 'POST fill', CONCAT('fill-', seq), 'f', 'COMPLETED', '', 1, '', '', "
            "'[]', 0, NOW(6), NOW(6) - INTERVAL seq SECOND, NOW(6) + INTERVAL 1 DAY, 0 "
            "FROM seq_1_to_500000"
        )
    built: list[BaseException | None] = []

    def build() -> None:
        try:
            apply(AddIndexWithoutBlocking("idempotencyrecord", UPDATED))
            built.append(None)
        except BaseException as exc:
            built.append(exc)
        finally:
            connections.close_all()

    def building() -> bool:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE INFO LIKE %s",
                [f"CREATE INDEX `{UPDATED.name}`%"],
            )
            return bool(cursor.fetchone()[0])

    builder = threading.Thread(target=build)
    inserted_during_build = 0
    try:
        builder.start()
        deadline = time.monotonic() + 120
        while not building():
            assert builder.is_alive() and time.monotonic() < deadline, f"no build seen: {built}"
            time.sleep(0.005)
        while time.monotonic() < deadline:
            now = timezone.now()
            IdempotencyRecord.objects.create(
                tenant="t", operation="op", key=f"during-{inserted_during_build}",
                fingerprint="f", state="CLAIMED", created_at=now, updated_at=now,
                expires_at=now + timedelta(days=1),
            )  # fmt: skip
            # Committed (autocommit) while the CREATE INDEX statement still runs.
            if not building():
                break
            inserted_during_build += 1
        builder.join(120)
        assert built == [None], built
        print(f"\n{inserted_during_build} rows inserted while the index was built online")
        assert inserted_during_build > 0
        assert indexes()[UPDATED.name]["columns"] == ["updated_at"]
    finally:
        builder.join(120)
        if UPDATED.name in indexes():
            with connection.cursor() as cursor:
                cursor.execute(f"DROP INDEX {UPDATED.name} ON {TABLE}")


# The non-blocking index operations and migration 0007 under squashing,
# concurrent builds, old snapshots and routers.
#
# What these tests show (django_idempotency/migration_operations.py,
# migrations/0007_add_created_at_brin_index.py); "was failing" marks a
# behaviour that was wrong before the package was fixed.
#
# - was failing, fixed (the operations subclass ``IndexOperation``, not
#   ``AddIndex``/``RemoveIndex``): ``squashmigrations`` folds an
#   ``AddIndexWithoutBlocking`` into the ``CreateModel`` right before it.
#   ``AddIndexWithoutBlocking.reduce()`` returning False only stops the
#   optimizer when the index operation is the *earlier* one; the optimizer
#   also asks the earlier ``CreateModel.reduce(AddIndex...)``, which takes any
#   ``AddIndex`` subclass into ``Meta.indexes``: the index loses its
#   ``vendors`` (every database is asked to build it).
#   The writer test above asserts ``brin.reduce(removal) is False``, which
#   tests the other direction. (The package's own 0001..0007 are spared today
#   only by RunPython operations in between: a passing test.)
# - was failing, fixed (``pg_stat_progress_create_index`` consulted, the build
#   waited for) (PostgreSQL): a concurrent build still IN PROGRESS in another
#   session (a second ``migrate`` started by another pod of the same deploy)
#   looks exactly like a failed build's leftover in ``pg_index``
#   (``indisvalid`` false): the second run sets out to drop it, queues behind
#   the first build, and then fails with PostgreSQL's internal error "tuple
#   concurrently updated".
# - passes (PostgreSQL): a session holding an old snapshot makes 0007 wait,
#   with no bound, for as long as it stays open; it goes on once it ends.
#   docs/upgrading.md said it "takes longer", not that an idle-in-transaction
#   session (a worker cut off mid-transaction) holds it until the server ends
#   that session, nor how to bound it (it says so now; the bound, a
#   ``lock_timeout``, is tested above).
# - passes: a router that keeps the app's records off an alias keeps 0007 off
#   it too, and the migration is still recorded there.

#: Bound on every wait for another thread or session to reach a state: only a hang gets near it.
HANG = 60.0


def _migrate_to(target: tuple[str, str]) -> None:
    MigrationExecutor(connection).migrate([target])


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
    The second run must not take it for a failed build's leftover. Once it
    did: it waited on the first build's table lock, then dropped the index
    the first build had just finished and built it again (on a large table:
    the whole build twice, and no index between the two).
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
    the middle of a transaction by a network partition) keeps it until the
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


# -- Columns added without queueing writes (0008) -----------------------------------------


def columns() -> set[str]:
    with connection.cursor() as cursor:
        return {
            column.name for column in connection.introspection.get_table_description(cursor, TABLE)
        }


def steps_trigger_exists() -> bool:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM sqlite_master WHERE type = 'trigger' AND tbl_name = %s", [TABLE]
        )
        return bool(cursor.fetchone()[0])


@pytest.fixture
def at_0007() -> Iterator[None]:
    """The records table as 0007 left it; migrated to the latest again afterwards."""
    migrate_to(AFTER)
    try:
        yield
    finally:
        executor = MigrationExecutor(connection)
        executor.migrate(executor.loader.graph.leaf_nodes(APP))


@pytest.mark.django_db(transaction=True)
def test_0008_adds_the_digest_columns_and_migrates_back_and_forth(at_0007: None) -> None:
    assert not columns() & DIGEST_COLUMNS
    migrate_to(DIGESTS)
    assert columns() >= DIGEST_COLUMNS
    migrate_to(AFTER)
    assert not columns() & DIGEST_COLUMNS
    if connection.vendor == "sqlite":
        # ALTER TABLE, not Django's rebuild of the table, which drops triggers.
        assert steps_trigger_exists()


@pytest.mark.django_db(transaction=True)
def test_sqlmigrate_shows_the_columns_each_database_adds() -> None:
    out = io.StringIO()
    call_command("sqlmigrate", APP, "0008", stdout=out)
    printed = out.getvalue()
    if connection.vendor == "mysql":
        assert "ADD COLUMN `principal_digest` varchar(96) NULL, ALGORITHM=INSTANT;" in printed
    else:
        assert f'ALTER TABLE "{TABLE}" ADD COLUMN "principal_digest" varchar(96) NULL' in printed
    assert "credential_digest" in printed


@pytest.mark.parametrize(
    ("field", "problem"),
    [
        (models.CharField(max_length=8), "is not nullable"),
        (models.CharField(max_length=8, null=True, default="x"), "has a default"),
        (models.CharField(max_length=8, null=True, db_default="x"), "has a default"),
        (models.CharField(max_length=8, null=True, db_index=True), "is unique or indexed"),
    ],
    ids=["not-null", "default", "db-default", "indexed"],
)
def test_a_field_that_would_touch_the_rows_is_refused(
    field: models.Field[Any, Any], problem: str
) -> None:
    with pytest.raises(ValueError, match=problem):
        AddFieldWithoutBlocking("idempotencyrecord", "probe", field)


def test_the_column_operation_is_written_and_read_back_by_djangos_migration_writer() -> None:
    operation = AddFieldWithoutBlocking(
        "idempotencyrecord", "probe", models.CharField(max_length=8, null=True)
    )
    text, imports = MigrationWriter.serialize(operation)
    assert text.startswith("django_idempotency.migration_operations.AddFieldWithoutBlocking(")
    assert "import django_idempotency.migration_operations" in imports
    name, args, kwargs = operation.deconstruct()
    assert type(operation)(*args, **kwargs).deconstruct() == (name, args, kwargs)


class _TableHeld:
    """Another session in a transaction that read the records table, until it ends.

    Any transaction that touched the table holds a lock on it until it
    ends (PostgreSQL's ACCESS SHARE, MariaDB's shared metadata lock): the
    ``ALTER TABLE`` must wait for it.
    """

    def __enter__(self) -> _TableHeld:
        self.other = connections.create_connection("default")
        self.other.set_autocommit(False)
        with self.other.cursor() as cursor:
            cursor.execute(f"SELECT count(*) FROM {TABLE}")
        return self

    def __exit__(self, *exc: object) -> None:
        self.other.rollback()
        self.other.close()


def _claim_waiting_at_most(seconds: int) -> None:
    """Insert a record as a claim does, giving up after ``seconds`` of waiting for a lock."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(f"SET lock_timeout = '{seconds}s'")
        else:
            cursor.execute(f"SET SESSION lock_wait_timeout = {seconds}")
    insert_record_as_0006_has_it("during-the-alter", "CLAIMED", created_at=timezone.now())


def _alter_waiting() -> int:
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND query LIKE 'ALTER TABLE%%'"
            )
        else:
            cursor.execute(
                "SELECT count(*) FROM information_schema.processlist "
                "WHERE state LIKE 'Waiting for table metadata lock%%' AND info LIKE 'ALTER TABLE%%'"
            )
        return int(cursor.fetchone()[0])


@pytest.mark.django_db(transaction=True)
def test_a_claim_goes_on_while_the_column_waits_for_a_transaction_holding_the_table(
    at_0007: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a bound, the INSERT would queue behind the waiting ALTER until the holder ends."""
    if connection.vendor == "sqlite":
        pytest.skip("SQLite has no lock queue: one writer at a time")
    monkeypatch.setattr(AddFieldWithoutBlocking, "lock_wait", timedelta(seconds=1))
    with _TableHeld() as held:
        migrating, done = _in_a_thread(lambda: migrate_to(DIGESTS))
        _wait_until(lambda: _alter_waiting() >= 1, "the ALTER TABLE to wait for the holder")

        _claim_waiting_at_most(30)  # raises if it queued behind the ALTER for 30 s

        assert not done, done  # the holder still holds: the column is not there yet
        held.other.rollback()
        migrating.join(HANG)
    assert done == [None], done
    assert columns() >= DIGEST_COLUMNS
    assert IdempotencyRecord.objects.filter(key="during-the-alter").exists()


@pytest.mark.django_db(transaction=True)
def test_a_table_held_past_every_attempt_fails_the_migration_and_changes_nothing(
    at_0007: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if connection.vendor == "sqlite":
        pytest.skip("SQLite has no lock queue: one writer at a time")
    monkeypatch.setattr(AddFieldWithoutBlocking, "lock_wait", timedelta(seconds=1))
    monkeypatch.setattr(AddFieldWithoutBlocking, "attempts", 2)
    monkeypatch.setattr(AddFieldWithoutBlocking, "pause", 0.0)
    with _TableHeld(), pytest.raises(Exception, match="migrate again once it ended"):
        migrate_to(DIGESTS)

    assert not columns() & DIGEST_COLUMNS
    assert DIGESTS not in MigrationExecutor(connection).loader.applied_migrations
    with connection.cursor() as cursor:  # the session's own bound is back
        if connection.vendor == "postgresql":
            cursor.execute("SELECT current_setting('lock_timeout')")
            assert cursor.fetchone()[0] == "0"


#: Migration 0009: the recovery and expiry indexes made partial where partial indexes exist.
PARTIAL = (APP, "0009_make_recovery_and_expiry_indexes_partial")
PARTIAL_INDEXES = {
    "idempotency_unresolved_lease": ["lease_expires_at"],
    "idempotency_resolved_expiry": ["expires_at"],
}
PLAIN_INDEXES = {
    "django_idempotency_recovery": ["state", "lease_expires_at"],
    "django_idempotency_expiry": ["expires_at"],
}


def index_definitions() -> dict[str, str]:
    """The CREATE INDEX of each index of the records table (PostgreSQL and SQLite)."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = %s", [TABLE]
            )
        else:
            cursor.execute(
                "SELECT name, sql FROM sqlite_master WHERE type = 'index' AND tbl_name = %s",
                [TABLE],
            )
        return {name: definition or "" for name, definition in cursor.fetchall()}


def assert_recovery_and_expiry_indexes_as_0009_leaves_them() -> None:
    found = {name: info["columns"] for name, info in indexes().items()}
    if connection.vendor == "mysql":
        # No partial indexes there: the plain ones stay, and no others.
        assert {name: found.get(name) for name in PLAIN_INDEXES} == PLAIN_INDEXES
        assert not set(PARTIAL_INDEXES) & set(found)
        return
    assert {name: found.get(name) for name in PARTIAL_INDEXES} == PARTIAL_INDEXES
    assert not set(PLAIN_INDEXES) & set(found)
    definitions = index_definitions()
    unresolved, resolved = (definitions[name] for name in PARTIAL_INDEXES)
    for state in ("CLAIMED", "IN_PROGRESS", "UNCERTAIN"):
        assert f"'{state}'" in unresolved.split("WHERE", 1)[1]
    for state in ("COMPLETED", "FAILED"):
        assert f"'{state}'" in resolved.split("WHERE", 1)[1]


@pytest.mark.django_db(transaction=True)
def test_0009_leaves_partial_indexes_where_they_exist_and_the_plain_ones_on_mysql() -> None:
    assert_recovery_and_expiry_indexes_as_0009_leaves_them()
    # The model state holds the partial ones: makemigrations has nothing to say.
    assert set(PARTIAL_INDEXES) <= {index.name for index in IdempotencyRecord._meta.indexes}


@pytest.fixture
def at_0008() -> Iterator[None]:
    """The records table as 0008 left it; migrated to the latest again afterwards."""
    migrate_to(DIGESTS)
    try:
        yield
    finally:
        executor = MigrationExecutor(connection)
        executor.migrate(executor.loader.graph.leaf_nodes(APP))


@pytest.mark.django_db(transaction=True)
def test_0009_migrates_back_and_forth(at_0008: None) -> None:
    found = {name: info["columns"] for name, info in indexes().items()}
    assert {name: found.get(name) for name in PLAIN_INDEXES} == PLAIN_INDEXES
    assert not set(PARTIAL_INDEXES) & set(found)
    migrate_to(PARTIAL)
    assert_recovery_and_expiry_indexes_as_0009_leaves_them()
    migrate_to(DIGESTS)
    found = {name: info["columns"] for name, info in indexes().items()}
    assert {name: found.get(name) for name in PLAIN_INDEXES} == PLAIN_INDEXES
    assert not set(PARTIAL_INDEXES) & set(found)
    if connection.vendor == "sqlite":
        assert steps_trigger_exists()  # indexes only: the table was never rebuilt


@pytest.mark.django_db(transaction=True)
def test_sqlmigrate_shows_0009_building_before_dropping_without_blocking() -> None:
    out = io.StringIO()
    call_command("sqlmigrate", APP, "0009", stdout=out)
    printed = out.getvalue()
    if connection.vendor == "postgresql":
        assert "BEGIN;" not in printed  # not atomic
        built = printed.index('CREATE INDEX CONCURRENTLY "idempotency_unresolved_lease"')
        assert printed.index('CREATE INDEX CONCURRENTLY "idempotency_resolved_expiry"') > built
        dropped = printed.index('DROP INDEX CONCURRENTLY IF EXISTS "django_idempotency_recovery"')
        assert dropped > built
        assert 'DROP INDEX CONCURRENTLY IF EXISTS "django_idempotency_expiry"' in printed
    elif connection.vendor == "mysql":
        assert "CREATE INDEX" not in printed and "DROP INDEX" not in printed
