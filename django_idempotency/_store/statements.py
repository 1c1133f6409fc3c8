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
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from django.core.signals import setting_changed
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import DateTimeField
from django.db.models.base import ModelState
from django.db.models.signals import post_init, pre_init

from django_idempotency._store import wait_bounds
from django_idempotency._store.database_time import DatabaseClock, clock_of
from django_idempotency.models import RESOLVED_STATES, IdempotencyRecord

_FIELDS = tuple(IdempotencyRecord._meta.concrete_fields)
#: The attribute names of the columns every statement reading a record returns, in order.
FIELD_NAMES = tuple(field.attname for field in _FIELDS)
_COLUMNS = tuple(str(field.column) for field in _FIELDS)
_TIME_COLUMNS = frozenset(str(f.column) for f in _FIELDS if isinstance(f, DateTimeField))
#: The scope's columns: a record found by its scope has the scope's values there.
_SCOPE_NAMES = ("tenant", "operation", "key")
#: Left unread by the lookup that decides a request's answer (``find_to_answer``):
#: nothing on that path reads them (when/who created it, the sender's digests,
#: the provider's id), and they are deferred fields of the record it returns,
#: loaded by the ORM if something reads them after all. Two fewer times to
#: convert, on both sides of the wire.
_UNREAD_TO_ANSWER = frozenset(
    {"provider_operation_id", "created_at", "updated_at", "principal_digest", "credential_digest"}
)

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
    #: The claim, its lease, retention and bound on waiting still to be
    #: spelled in (``claim_for()``). PostgreSQL only.
    claim_template: str
    #: tenant, operation, key -> the record's row, if any, then the
    #: database's time (on a database clock; see ``find_reads_time``).
    find: str
    #: ``find``, reading only what deciding and giving a request's answer
    #: needs (``ANSWERING``'s columns).
    find_to_answer: str
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
    #: ``claim_for()``'s statements, per (lease, retention, bound).
    claims: dict[tuple[timedelta, timedelta, timedelta | None], str] = field(
        default_factory=dict, compare=False, repr=False
    )

    @property
    def find_reads_time(self) -> bool:
        """Whether ``find`` returns the database's time as one more column."""
        return not self.clock.host


def claim_for(
    statements: Statements, lease: timedelta, ttl: timedelta, wait: timedelta | None
) -> str:
    """The claim for a lease of ``lease`` and a retention of ``ttl`` (PostgreSQL only).

    Its parameters: tenant, operation, key, fingerprint, lease owner,
    principal digest, credential digest -> one row (id) if claimed, none if
    the scope is taken. With ``wait``, it first sets ``lock_timeout`` for
    the rest of its transaction to that, before it can wait on a duplicate.

    The durations and the bound are a view's settings, a handful of values
    per process: spelled in the statement as constants, the database parses
    them once per statement instead of computing them per row, and the
    client sends four parameters fewer (measured: 0.02 ms less of the
    server's CPU per claim, a tenth of the statement).
    """
    spelled = (lease, ttl, wait)
    try:
        return statements.claims[spelled]
    except KeyError:
        pass
    # The lease owner's value is where the bound is set: the row's values are
    # computed before the INSERT tries the unique index, so the timeout is in
    # force when it waits on a concurrent version of the scope's row.
    owner = "%s"
    if wait is not None:
        owner = (
            f"(%s || left(set_config('lock_timeout', '{wait_bounds.milliseconds(wait)}', true), 0))"
        )
    claim = statements.claim_template.format(
        owner=owner, lease=_interval(lease), ttl=_interval(ttl)
    )
    if len(statements.claims) >= _CLAIMS_KEPT:
        # Durations computed per request (a task's, say) would otherwise
        # grow this without end; a view's come back, and are made again.
        statements.claims.clear()
    statements.claims[spelled] = claim
    return claim


#: How many claim statements ``claim_for()`` keeps per connection's statements.
_CLAIMS_KEPT = 64


def _interval(duration: timedelta) -> str:
    """``duration`` as an exact PostgreSQL interval constant (hours and seconds, no day part).

    Each number small: PostgreSQL 14 and older read every number of an
    interval literal as a 32-bit int, so a day in microseconds is refused.
    """
    microseconds = (duration.days * 86_400 + duration.seconds) * 1_000_000 + duration.microseconds
    sign = "-" if microseconds < 0 else ""
    hours, rest = divmod(abs(microseconds), 3_600_000_000)
    seconds, fraction = divmod(rest, 1_000_000)
    return f"interval '{sign}{hours} hours {sign}{seconds}.{fraction:06d} seconds'"


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

    def read(columns: Sequence[str]) -> str:
        return ", ".join(
            read_as(quote(column)) if column in _TIME_COLUMNS else quote(column)
            for column in columns
        )

    columns = read(_COLUMNS)
    scope = ", ".join(quote(name) for name in ("tenant", "operation", "key"))
    where_scope = " AND ".join(f"{quote(name)} = %s" for name in ("tenant", "operation", "key"))
    claim_columns = ", ".join(quote(name) for name in (*_CLAIM_COLUMNS, *_CLAIM_TIMES))
    insert = f"INSERT INTO {table} ({claim_columns}) "
    conflict = f"ON CONFLICT ({scope}) DO NOTHING RETURNING {quote('id')}"
    # The lease and the retention end on the database's clock
    # (store.database_time). claim_for() fills in the lease owner's value and
    # both durations (the names in braces: no SQL of this statement has one).
    claimed = IdempotencyRecord.State.CLAIMED.value
    claim_template = (
        f"{insert}VALUES (%s, %s, %s, %s, '{claimed}', {{owner}}, 1, '', '', '[]', %s, %s, "
        f"({clock.now} + {{lease}}), ({clock.now} + {{ttl}}), {clock.now}, {clock.now}) "
        f"{conflict}"
    )
    # The database's time comes with the row, for the judgments Python makes
    # on it (expired? abandoned?), at no extra round trip.
    read_time = "" if clock.host else f", {read_as(clock.now)}"
    find = f"SELECT {columns}{read_time} FROM {table} WHERE {where_scope}"
    find_to_answer = f"SELECT {read(ANSWERING.columns)}{read_time} FROM {table} WHERE {where_scope}"
    # "Not resolved", spelled as one inequality per resolved state rather than
    # state IN (the unresolved ones): the same rows (a record is in one of the
    # five states), but PostgreSQL's planner tries to prove the partial
    # indexes' predicates (state = ANY (...)) from an IN list, element by
    # element, on every completion: measured 84 us of planning against 51
    # us, a tenth of the statement's server time.
    not_resolved = " AND ".join(f"{quote('state')} <> '{state}'" for state in RESOLVED_STATES)
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
        f"AND {not_resolved}"
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
        claim_template,
        find,
        find_to_answer,
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


@dataclass(frozen=True, eq=False)
class Reading:
    """The columns a statement reads a record with, and how its rows become records."""

    #: The model fields read, in the model's order.
    fields: tuple[Any, ...]
    #: Their attribute names, and their columns.
    names: tuple[str, ...]
    columns: tuple[str, ...]
    #: Per connection, for the current USE_TZ (some backends convert
    #: datetimes only with it): emptied when a setting they follow changes.
    converters: weakref.WeakKeyDictionary[BaseDatabaseWrapper, Converters] = field(
        default_factory=weakref.WeakKeyDictionary
    )

    @classmethod
    def of(cls, fields: Sequence[Any]) -> Reading:
        return cls(
            tuple(fields),
            tuple(field.attname for field in fields),
            tuple(str(field.column) for field in fields),
        )


#: The whole record (``find``).
WHOLE = Reading.of(_FIELDS)
#: What deciding a request's answer reads (``find_to_answer``).
ANSWERING = Reading.of(
    [
        field
        for field in _FIELDS
        if field.attname not in _UNREAD_TO_ANSWER and field.attname not in _SCOPE_NAMES
    ]
)


def _forget_converters(*, setting: str, **kwargs: Any) -> None:
    # The clock too: MySQL's follows USE_TZ and the time zones.
    if setting in ("USE_TZ", "TIME_ZONE", "DATABASES"):
        for reading in (WHOLE, ANSWERING):
            reading.converters.clear()
        _read_time_converters.clear()
        _statements_of_connection.clear()


setting_changed.connect(_forget_converters, dispatch_uid="django_idempotency._store.statements")


def _sql_list(states: Sequence[str]) -> str:
    """The states as SQL literals: constants of ours, never client input."""
    return ", ".join(f"'{state}'" for state in states)


def record_from_row(
    connection: BaseDatabaseWrapper,
    row: Sequence[Any],
    reading: Reading = WHOLE,
    scope: tuple[str, str, str] | None = None,
) -> IdempotencyRecord:
    """A model instance from a row of ``reading``'s columns, converted as the ORM would.

    A column past those is the database's time of the read (``find``):
    it becomes ``read_at``, converted as a datetime column is. ``scope``
    (tenant, operation, key) fills those fields when the row does not
    carry them; fields neither read nor given are deferred.
    """
    try:
        converters = reading.converters[connection]
    except KeyError:
        converters = reading.converters[connection] = _converters_of(connection, reading)
    count = len(reading.fields)
    values = list(row[:count])
    read_at = row[count] if len(row) > count else None
    for index, functions, expression in converters:
        value = values[index]
        for function in functions:
            value = function(value, expression, connection)
        values[index] = value
    if read_at is not None:
        for function in _time_converters(connection):
            read_at = function(read_at, _EXPIRES_AT, connection)
    record = _instance(connection.alias, reading, values, scope)
    record.read_at = read_at
    return record


def _instance(
    alias: str, reading: Reading, values: list[Any], scope: tuple[str, str, str] | None
) -> IdempotencyRecord:
    """``IdempotencyRecord.from_db(alias, names, values)``, for less when nothing listens.

    What ``Model.__init__`` leaves, for every field given: each value under
    its attribute name, and a state saying the row came from ``alias``.
    Building that directly costs a fifth of the ORM's way, whose price is
    its ``pre_init`` and ``post_init`` signals; with a receiver connected to
    either (for any model: a project's, an ImageField's), the ORM's way.
    """
    attributes = dict(zip(reading.names, values, strict=True))
    if scope is not None:
        attributes.update(zip(_SCOPE_NAMES, scope, strict=True))
    if pre_init.receivers or post_init.receivers:
        names = [name for name in FIELD_NAMES if name in attributes]  # the model's order
        return IdempotencyRecord.from_db(alias, names, [attributes[name] for name in names])
    record = IdempotencyRecord.__new__(IdempotencyRecord)
    state = ModelState()
    state.adding = False
    state.db = alias
    attributes["_state"] = state
    record.__dict__.update(attributes)
    return record


#: A datetime column: the database's time of a read is converted as one is.
_EXPIRES_AT = IdempotencyRecord._meta.get_field("expires_at").get_col(
    IdempotencyRecord._meta.db_table
)


def _time_converters(connection: BaseDatabaseWrapper) -> list[Converter]:
    """How a datetime column read from ``connection`` is converted (the read time's too)."""
    try:
        return _read_time_converters[connection]
    except KeyError:
        functions = _functions_of(connection, _EXPIRES_AT.target, _EXPIRES_AT)
        _read_time_converters[connection] = functions
        return functions


_read_time_converters: weakref.WeakKeyDictionary[BaseDatabaseWrapper, list[Converter]]
_read_time_converters = weakref.WeakKeyDictionary()


def _converters_of(connection: BaseDatabaseWrapper, reading: Reading) -> Converters:
    table = IdempotencyRecord._meta.db_table
    found = []
    for index, model_field in enumerate(reading.fields):
        expression = model_field.get_col(table)
        functions = _functions_of(connection, model_field, expression)
        if functions:
            found.append((index, functions, expression))
    return found


def _functions_of(
    connection: BaseDatabaseWrapper, model_field: Any, expression: Any
) -> list[Converter]:
    functions: list[Converter] = connection.ops.get_db_converters(
        expression
    ) + model_field.get_db_converters(connection)
    if connection.vendor == "postgresql" and model_field.column in _TIME_COLUMNS:
        functions = [_from_epoch_microseconds, *functions]
    return functions
