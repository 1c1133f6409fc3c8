"""The hot path's statements in SQL, built once per database vendor.

Every protected request sends a claim, and then either a completion or a
lookup. Compiling a queryset for those costs more CPU than the database
spends running them (on the benchmark machine ``.filter()[:1]`` took 1.24 ms
of CPU against 0.24 ms for the same SELECT through a cursor, and
``.filter().update()`` 0.75 ms against 0.20 ms), so ``store`` sends these
strings instead. Rows read come back as model instances through the same
converters the ORM would apply, so callers cannot tell the difference.

Nothing here writes: ``store`` executes these statements.
"""

from __future__ import annotations

import weakref
import zoneinfo
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.core.signals import setting_changed
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import DateTimeField
from django.db.models.base import ModelState
from django.db.models.signals import post_init, pre_init

from django_idempotency._store import wait_bounds
from django_idempotency._store.database_time import DatabaseClock, clock_of
from django_idempotency.models import RESOLVED_STATES, UNRESOLVED_STATES, IdempotencyRecord

_FIELDS = tuple(IdempotencyRecord._meta.concrete_fields)
#: The attribute names of the columns every statement reading a record returns, in order.
FIELD_NAMES = tuple(field.attname for field in _FIELDS)
_COLUMNS = tuple(str(field.column) for field in _FIELDS)
_TIME_COLUMNS = frozenset(str(f.column) for f in _FIELDS if isinstance(f, DateTimeField))

#: Written by the claim; the times and constants spelled in its SQL follow.
_CLAIM_COLUMNS = (
    "tenant",
    "operation",
    "key",
    "fingerprint",
    "state",
    "lease_owner",
    "fencing_token",
    "provider_key",
    "provider_operation_id",
    "response_headers",
    "principal_digest",
    "credential_digest",
)
_CLAIM_TIMES = ("lease_expires_at", "expires_at", "created_at", "updated_at")
#: Where the lease owner is among the claim's parameters (the columns before
#: it each take one).
_LEASE_OWNER_PARAMETER = _CLAIM_COLUMNS.index("lease_owner")
#: Written by the optimistic mode's one INSERT of a finished record; the
#: constants and times spelled in its SQL follow.
_FINISHED_COLUMNS = (
    "tenant",
    "operation",
    "key",
    "fingerprint",
    "state",
    "response_status",
    "response_headers",
    "response_body",
    "response_sealed",
    "lease_owner",
    "lease_expires_at",
    "fencing_token",
    "provider_key",
    "provider_operation_id",
    "tombstone",
    "principal_digest",
    "credential_digest",
)
_FINISHED_TIMES = ("expires_at", "created_at", "updated_at")


@dataclass(frozen=True)
class Statements:
    #: Parameters of every claim: tenant, operation, key, fingerprint, state,
    #: lease owner, principal digest, credential digest, then the clock's
    #: parameters for the lease's end, the retention's end and the current
    #: time (twice).
    #: -> one row (id) if claimed, none if the scope is taken. PostgreSQL only.
    claim: str
    #: The claim, setting ``lock_timeout`` for the rest of the transaction
    #: before it can wait (one more parameter, right after the lease owner's:
    #: milliseconds, as text; ``with_lock_timeout()`` puts it there).
    #: PostgreSQL only.
    claim_waiting_at_most: str
    #: tenant, operation, key -> the record's row, if any, then the
    #: database's time (on a database clock; see ``find_reads_time``).
    find: str
    #: state, status, headers, body, sealed, then the clock's parameters for
    #: the retention's end (twice) and the current time, then id, fencing
    #: token -> rowcount 1, or 0 for a stale owner.
    complete: str
    #: scan start, limit -> (rows deleted, latest expiry deleted).
    #: PostgreSQL only.
    purge: str
    #: The purge with ``TOMBSTONE_TTL`` set: scan start, limit, then minus
    #: the tombstones' time, that time, and minus it again (seconds) ->
    #: (rows deleted, rows turned into tombstones, latest expiry of either,
    #: as it was before the batch). PostgreSQL only.
    purge_to_tombstones: str
    #: The clock the statements read the time from.
    clock: DatabaseClock
    #: A finished record, as the optimistic mode writes it at the end of the
    #: view's transaction: tenant, operation, key, fingerprint, state,
    #: status, headers, body, sealed, then (PostgreSQL only) the bound on its
    #: wait (milliseconds, as text), then principal digest, credential
    #: digest, then the clock's parameters for the retention's end and the
    #: current time (twice) -> rowcount 1; a plain INSERT, so a scope already
    #: taken raises an IntegrityError (the unique constraint's).
    insert_finished: str = ""

    @property
    def find_reads_time(self) -> bool:
        """Whether ``find`` returns the database's time as one more column."""
        return not self.clock.host


def with_lock_timeout(claim_params: Sequence[Any], wait: timedelta) -> list[Any]:
    """The claim's parameters for ``claim_waiting_at_most``: the bound after the lease owner."""
    after_owner = _LEASE_OWNER_PARAMETER + 1
    bound = wait_bounds.milliseconds(wait)
    return [*claim_params[:after_owner], bound, *claim_params[after_owner:]]


#: Per vendor and clock (MySQL's depends on USE_TZ).
_statements: dict[tuple[str, DatabaseClock], Statements] = {}


def statements_for(connection: BaseDatabaseWrapper) -> Statements:
    # Asked for every statement of every request: kept per connection, with
    # the time zone its clock follows (a cached property, read as a plain
    # attribute), which a test may change in DATABASES without a signal.
    zone = connection.timezone_name
    try:
        kept = _statements_of_connection.get(connection)
    except TypeError:  # django.db.connection, a proxy: unhashable, so kept per vendor only
        return _built_for(connection)
    if kept is not None and kept[0] == zone:
        return kept[1]
    built = _built_for(connection)
    _statements_of_connection[connection] = (zone, built)
    return built


def _built_for(connection: BaseDatabaseWrapper) -> Statements:
    built_for = (connection.vendor, clock_of(connection))
    built = _statements.get(built_for)
    if built is None:
        built = _statements[built_for] = _build(connection, built_for[1])
    return built


_statements_of_connection: weakref.WeakKeyDictionary[BaseDatabaseWrapper, tuple[str, Statements]]
_statements_of_connection = weakref.WeakKeyDictionary()


def _build(connection: BaseDatabaseWrapper, clock: DatabaseClock) -> Statements:
    quote = connection.ops.quote_name
    table = quote(IdempotencyRecord._meta.db_table)
    read_as = _as_epoch_microseconds if connection.vendor == "postgresql" else _as_is
    columns = ", ".join(
        read_as(quote(column)) if column in _TIME_COLUMNS else quote(column) for column in _COLUMNS
    )
    scope = ", ".join(quote(name) for name in ("tenant", "operation", "key"))
    where_scope = " AND ".join(f"{quote(name)} = %s" for name in ("tenant", "operation", "key"))
    claim_columns = ", ".join(quote(name) for name in (*_CLAIM_COLUMNS, *_CLAIM_TIMES))
    insert = f"INSERT INTO {table} ({claim_columns}) "
    conflict = f"ON CONFLICT ({scope}) DO NOTHING RETURNING {quote('id')}"
    # The lease and the retention end on the database's clock (store.database_time).
    claim_values = (
        f"%s, %s, %s, %s, %s, %s, 1, '', '', '[]', %s, %s, "
        f"{clock.later}, {clock.later}, {clock.now}, {clock.now}"
    )
    claim = f"{insert}VALUES ({claim_values}) {conflict}"
    # The row's values are computed before the INSERT tries the unique index,
    # so a timeout set while computing one (the lease owner's, which it leaves
    # as it is) is in force when the INSERT waits on a concurrent version of
    # the scope's row. One round trip instead of two: measured 0.01-0.03 ms
    # more per claim than the plain claim, against 0.03-0.05 ms for an
    # INSERT ... SELECT ... WHERE set_config(...) (the planner's work).
    waiting_values = claim_values.replace(
        "%s, 1, ", f"(%s || left({wait_bounds.exactly('lock_timeout')}, 0)), 1, ", 1
    )
    claim_waiting_at_most = f"{insert}VALUES ({waiting_values}) {conflict}"
    # The database's time comes with the row, for the judgments Python makes
    # on it (expired? abandoned?), at no extra round trip.
    read_time = "" if clock.host else f", {read_as(clock.now)}"
    find = f"SELECT {columns}{read_time} FROM {table} WHERE {where_scope}"
    unresolved = _sql_list(UNRESOLVED_STATES)
    expires_at = quote("expires_at")
    complete = (
        f"UPDATE {table} SET {quote('state')} = %s, {quote('response_status')} = %s, "
        f"{quote('response_headers')} = %s, {quote('response_body')} = %s, "
        # In the same statement as the response: a sealed response is never
        # readable as plaintext, nor a plaintext one taken for ciphertext.
        f"{quote('response_sealed')} = %s, "
        f"{quote('lease_owner')} = '', {quote('lease_expires_at')} = NULL, "
        # An operator may have extended retention already: never shorten it.
        f"{expires_at} = CASE WHEN {expires_at} > {clock.later} THEN {expires_at} "
        f"ELSE {clock.later} END, "
        f"{quote('updated_at')} = {clock.now} "
        f"WHERE {quote('id')} = %s AND {quote('fencing_token')} = %s "
        f"AND {quote('state')} IN ({unresolved})"
    )
    state_column = quote("state")
    resolved = _sql_list(RESOLVED_STATES)
    expired = f"{state_column} IN ({resolved}) AND {expires_at} <= {clock.now}"
    # One statement per batch: no id list travels to the client and back.
    # The scan starts where the previous batch ended, past index entries of
    # rows already deleted (only VACUUM removes those, and rescanning them
    # made every batch slower than the last). SKIP LOCKED passes over rows a
    # concurrent purge or an operator holds. The batch is MATERIALIZED: as
    # ``WHERE id IN (SELECT ... SKIP LOCKED)`` the planner may run the
    # subquery more than once, each run locking other rows, and delete more
    # than the limit. The DELETE repeats the conditions, which PostgreSQL
    # re-checks on a row changed meanwhile.
    qualified = f"record.{state_column} IN ({resolved}) AND record.{expires_at} <= {clock.now}"
    purge = (
        f"WITH batch AS MATERIALIZED (SELECT {quote('id')} FROM {table} "
        f"WHERE {expired} AND {expires_at} >= %s "
        f"ORDER BY {expires_at} LIMIT %s FOR UPDATE SKIP LOCKED), "
        f"purged AS (DELETE FROM {table} AS record USING batch "
        f"WHERE record.{quote('id')} = batch.{quote('id')} AND {qualified} "
        f"RETURNING record.{expires_at}) "
        f"SELECT count(*), max({expires_at}) FROM purged"
    )
    # With TOMBSTONE_TTL: the same batch, each of its rows either deleted (a
    # tombstone past its own expiry, or a record past expires_at plus the
    # tombstones' time, which a claim would discard too) or made a tombstone,
    # its expires_at moved on so that the scan meets it once more, when it
    # is to go. The two conditions exclude each other (one snapshot, one
    # statement time), so no row is changed twice. The scan goes on from
    # the expiries the rows had (the batch's), not the moved ones.
    tombstone = quote("tombstone")
    past_tombstone = f"(record.{tombstone} OR record.{expires_at} <= {clock.later})"
    purge_to_tombstones = (
        f"WITH batch AS MATERIALIZED (SELECT {quote('id')}, {expires_at} FROM {table} "
        f"WHERE {expired} AND {expires_at} >= %s "
        f"ORDER BY {expires_at} LIMIT %s FOR UPDATE SKIP LOCKED), "
        f"purged AS (DELETE FROM {table} AS record USING batch "
        f"WHERE record.{quote('id')} = batch.{quote('id')} AND {qualified} "
        f"AND {past_tombstone} RETURNING batch.{expires_at}), "
        f"buried AS (UPDATE {table} AS record SET {quote('response_body')} = NULL, "
        f"{quote('response_headers')} = '[]', {quote('response_sealed')} = false, "
        f"{tombstone} = true, {expires_at} = record.{expires_at} + make_interval(secs => %s), "
        f"{quote('updated_at')} = {clock.now} FROM batch "
        f"WHERE record.{quote('id')} = batch.{quote('id')} AND {qualified} "
        f"AND NOT {past_tombstone} RETURNING batch.{expires_at}) "
        "SELECT (SELECT count(*) FROM purged), (SELECT count(*) FROM buried), "
        f"GREATEST((SELECT max({expires_at}) FROM purged), (SELECT max({expires_at}) FROM buried))"
    )
    # A plain INSERT, not ON CONFLICT DO NOTHING: losing it means the whole
    # transaction rolls back anyway (the view's writes with it), so the
    # unique constraint's error says "taken" as well as a rowcount of 0
    # would, and the speculative insertion ON CONFLICT needs (a probe of the
    # unique index first, then a confirmation record: 48 bytes of WAL per
    # record) is saved. On PostgreSQL the row's lease owner, '', is computed
    # by the set_config() that bounds the INSERT's wait on a duplicate's
    # uncommitted record: the values are computed before the row meets the
    # unique index, so the bound is in force when it waits (as in the claim),
    # and nothing of the transaction runs after it but the COMMIT.
    bounded_owner = (
        f"left({wait_bounds.exactly('lock_timeout')}, 0)"
        if connection.vendor == "postgresql"
        else "''"
    )
    finished_columns = ", ".join(quote(name) for name in (*_FINISHED_COLUMNS, *_FINISHED_TIMES))
    insert_finished = (
        f"INSERT INTO {table} ({finished_columns}) VALUES ("
        f"%s, %s, %s, %s, %s, %s, %s, %s, %s, {bounded_owner}, NULL, 1, '', '', false, %s, %s, "
        f"{clock.later}, {clock.now}, {clock.now})"
    )
    return Statements(
        claim,
        claim_waiting_at_most,
        find,
        complete,
        purge,
        purge_to_tombstones,
        clock,
        insert_finished=insert_finished,
    )


def _as_is(sql: str) -> str:
    return sql


def _as_epoch_microseconds(sql: str) -> str:
    """A timestamptz read as microseconds since the epoch (exact; PostgreSQL).

    Django's loader for timestamptz values subclasses psycopg's pure-Python
    one (to set the time zone): about 7 us of CPU per value on the benchmark
    machine, 28 us for the four a replay reads. A bigint goes through
    psycopg's C loader; ``_from_epoch_microseconds`` turns it into the
    datetime that loader would have given.
    """
    return f"(EXTRACT(EPOCH FROM {sql}) * 1000000)::bigint"


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _from_epoch_microseconds(value: Any, expression: Any, connection: BaseDatabaseWrapper) -> Any:
    """The datetime Django reads for a time column (``_as_epoch_microseconds``).

    Aware, in the connection's time zone (UTC) with ``USE_TZ``; else naive,
    the wall time in the connection's zone, as Django's own loader gives it.
    A datetime (a statement that reads the column as it is) passes unchanged.
    """
    if type(value) is not int:
        return value
    moment = _EPOCH + timedelta(microseconds=value)
    zone = connection.timezone
    if zone is None:  # USE_TZ = False
        wall_zone = zoneinfo.ZoneInfo(connection.timezone_name)
        return moment.astimezone(wall_zone).replace(tzinfo=None)
    return moment if zone is UTC else moment.astimezone(zone)


Converter = Callable[[Any, Any, BaseDatabaseWrapper], Any]
Converters = list[tuple[int, list[Converter], Any]]
#: Per connection, for the current USE_TZ (some backends convert datetimes
#: only with it): emptied when a setting they follow changes.
_converters: weakref.WeakKeyDictionary[BaseDatabaseWrapper, Converters]
_converters = weakref.WeakKeyDictionary()


def _forget_converters(*, setting: str, **kwargs: Any) -> None:
    # The clock too: MySQL's follows USE_TZ and the time zones.
    if setting in ("USE_TZ", "TIME_ZONE", "DATABASES"):
        _converters.clear()
        _statements_of_connection.clear()


setting_changed.connect(_forget_converters, dispatch_uid="django_idempotency._store.statements")


def _sql_list(states: Sequence[str]) -> str:
    """The states as SQL literals: constants of ours, never client input."""
    return ", ".join(f"'{state}'" for state in states)


def record_from_row(connection: BaseDatabaseWrapper, row: Sequence[Any]) -> IdempotencyRecord:
    """A model instance from a row of ``FIELD_NAMES``, converted as the ORM would.

    A column past those is the database's time of the read (``find``):
    it becomes ``read_at``, converted as a datetime column is.
    """
    try:
        converters = _converters[connection]
    except KeyError:
        converters = _converters[connection] = _converters_of(connection)
    values = list(row[:_FIELD_COUNT])
    read_at = row[_FIELD_COUNT] if len(row) > _FIELD_COUNT else None
    for index, functions, expression in converters:
        value = values[index]
        for function in functions:
            value = function(value, expression, connection)
            if index == _EXPIRES_AT and read_at is not None:
                read_at = function(read_at, expression, connection)
        values[index] = value
    record = _instance(connection.alias, values)
    record.read_at = read_at
    return record


_FIELD_COUNT = len(FIELD_NAMES)


def _instance(alias: str, values: list[Any]) -> IdempotencyRecord:
    """``IdempotencyRecord.from_db(alias, FIELD_NAMES, values)``, for less when nothing listens.

    What ``Model.__init__`` leaves, for every field given: each value under
    its attribute name, and a state saying the row came from ``alias``.
    Building that directly costs a fifth of the ORM's way, whose price is
    its ``pre_init`` and ``post_init`` signals; with a receiver connected to
    either (for any model: a project's, an ImageField's), the ORM's way.
    """
    if pre_init.receivers or post_init.receivers:
        return IdempotencyRecord.from_db(alias, FIELD_NAMES, values)
    record = IdempotencyRecord.__new__(IdempotencyRecord)
    state = ModelState()
    state.adding = False
    state.db = alias
    attributes = dict(zip(FIELD_NAMES, values, strict=True))
    attributes["_state"] = state
    record.__dict__.update(attributes)
    return record


#: A datetime column: the database's time of a read is converted as it is.
_EXPIRES_AT = FIELD_NAMES.index("expires_at")


def _converters_of(connection: BaseDatabaseWrapper) -> Converters:
    table = IdempotencyRecord._meta.db_table
    found = []
    for index, field in enumerate(_FIELDS):
        expression = field.get_col(table)
        functions = connection.ops.get_db_converters(expression) + field.get_db_converters(
            connection
        )
        if connection.vendor == "postgresql" and field.column in _TIME_COLUMNS:
            functions = [_from_epoch_microseconds, *functions]
        if functions:
            found.append((index, functions, expression))
    return found
