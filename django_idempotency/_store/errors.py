"""Telling a store outage from a database error that is only contention.

``FAIL_OPEN`` and the 503 ``idempotency_store_unavailable`` are for a store
that cannot be reached. A deadlock, a lock or statement timeout or a
serialization failure comes from a database that is up and busy, often
with this very key (a duplicate holding the unique index): answering it as
an outage would run the view a second time under ``FAIL_OPEN``, or tell the
client "not run" about a store that was fine.
"""

from __future__ import annotations

from django.db import DatabaseError, InterfaceError

#: PostgreSQL SQLSTATEs of a busy database: serialization_failure,
#: deadlock_detected, lock_not_available (lock_timeout), query_canceled
#: (statement_timeout).
_POSTGRESQL_CONTENTION = frozenset({"40001", "40P01", "55P03", "57014"})
#: PostgreSQL SQLSTATEs of a session that is gone: the connection_exception
#: class, and the server shutting down or refusing connections.
_POSTGRESQL_GONE_CLASS = "08"
_POSTGRESQL_GONE = frozenset({"57P01", "57P02", "57P03", "53300"})
#: MySQL/MariaDB error numbers of a busy database: lock wait timeout,
#: deadlock, statement timeouts (MySQL's max_execution_time, MariaDB's
#: max_statement_time), NOWAIT, and MariaDB's "record has changed since last
#: read" (REPEATABLE READ with innodb_snapshot_isolation).
_MYSQL_CONTENTION = frozenset({1020, 1205, 1213, 1969, 3024, 3572})
#: ... and of a session that is gone (client-side codes 2002-2055, "too many
#: connections", server shutdown, MariaDB's "connection was killed", MySQL's
#: "disconnected by the server because of inactivity").
_MYSQL_GONE = frozenset({1040, 1053, 1927, 2002, 2003, 2006, 2013, 2055, 4031})


def _driver_error(exc: BaseException) -> BaseException | None:
    # Django re-raises driver errors as its own classes, the original as the cause.
    return exc.__cause__ if exc.__cause__ is not None else None


def _driver(exc: BaseException) -> str:
    """The driver's top-level module: psycopg, psycopg2, MySQLdb, pymysql, sqlite3."""
    return type(_driver_error(exc)).__module__.partition(".")[0]


def _sqlstate(exc: BaseException) -> str | None:
    """PostgreSQL's SQLSTATE (MySQL drivers have one too, but it is mostly HY000)."""
    if not _driver(exc).startswith("psycopg"):
        return None
    cause = _driver_error(exc)
    state = getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None)
    return state if isinstance(state, str) else None


def _mysql_errno(exc: BaseException) -> int | None:
    if _driver(exc) not in {"MySQLdb", "pymysql"}:
        return None
    args = getattr(_driver_error(exc), "args", ())
    return args[0] if args and isinstance(args[0], int) else None


def _is_sqlite(exc: BaseException) -> bool:
    return _driver(exc) == "sqlite3"


def is_contention(exc: BaseException) -> bool:
    """A deadlock, a lock or statement timeout, or a serialization failure."""
    if not isinstance(exc, DatabaseError):
        return False
    if _is_sqlite(exc):  # its one writer's lock timed out
        return "locked" in str(exc)
    state = _sqlstate(exc)
    if state is not None:
        return state in _POSTGRESQL_CONTENTION
    return _mysql_errno(exc) in _MYSQL_CONTENTION


def is_deadlock(exc: BaseException) -> bool:
    """The database chose this transaction as a deadlock's victim and rolled it back."""
    if not isinstance(exc, DatabaseError):
        return False
    state = _sqlstate(exc)
    if state is not None:
        return state == "40P01"
    return _mysql_errno(exc) == 1213


def is_serialization_failure(exc: BaseException) -> bool:
    """A row changed after the transaction's snapshot (REPEATABLE READ and above).

    At the claim it means the key was taken, and committed, by a duplicate
    that this transaction's snapshot cannot see: a fresh look finds it.
    """
    if not isinstance(exc, DatabaseError):
        return False
    state = _sqlstate(exc)
    if state is not None:
        return state == "40001"
    return _mysql_errno(exc) == 1020


def is_connection_lost(exc: BaseException) -> bool:
    """The database could not be reached, or the session ended under us."""
    if isinstance(exc, InterfaceError):
        return True
    if not isinstance(exc, DatabaseError) or is_contention(exc):
        return False
    state = _sqlstate(exc)
    if state is not None:
        return state.startswith(_POSTGRESQL_GONE_CLASS) or state in _POSTGRESQL_GONE
    errno = _mysql_errno(exc)
    if errno is not None:
        return errno in _MYSQL_GONE
    if _is_sqlite(exc):  # a database file it cannot open or read
        return "unable to open" in str(exc) or "disk I/O" in str(exc)
    # psycopg reports a connection that failed or broke without a SQLSTATE.
    # (No driver error at all: Django raised it itself, e.g. a save() with
    # update_fields of a row deleted meanwhile: the view's error.)
    return _driver(exc).startswith("psycopg") and type(_driver_error(exc)).__name__ in {
        "OperationalError",
        "InterfaceError",
    }
