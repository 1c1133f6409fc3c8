"""Connections for record writes that must commit at once.

``begin_external()`` has to commit the intent while the view's own
transaction is still open: a crash during the external call must leave a
committed IN_PROGRESS record behind, while the view's uncommitted writes
vanish with the process. A connection cannot commit half of its
transaction, so such writes go through a second connection to the same
database, one per thread, opened on first use and closed as soon as the protected
view is done.

That second connection is made from the settings of the alias that
``IDEMPOTENCY["INTENT_DATABASES"]`` maps the records' alias to, else of the
records' alias itself. Behind a pooler in transaction mode (PgBouncer) this
matters: the view's open transaction holds one server connection of its
pool while the intent waits for another; once every server connection is
held by such a view, none is ever returned and the pool deadlocks until
``query_wait_timeout``. An alias of its own for the intents (a second
PgBouncer database entry for the same database) gives them a pool that the
views' transactions never hold. See docs/pgbouncer.md.

SQLite has one writer at a time: a second connection would wait for the
view's own transaction, forever. There the intent is written in the view's
transaction instead; the docs say so, and production belongs on PostgreSQL
or MySQL/MariaDB anyway.
"""

from __future__ import annotations

import threading

from django.db import connections

from django_idempotency.conf import idempotency_settings

_SUFFIX = "__idempotency_independent"
_opened = threading.local()


def commit_now_alias(alias: str) -> str:
    """The alias on which a record write commits immediately.

    Outside a transaction that is ``alias`` itself (autocommit). Inside one,
    it is a second connection to the same database, where the backend
    allows a second writer: made from the settings of the alias that
    ``IDEMPOTENCY["INTENT_DATABASES"]`` maps ``alias`` to, or of ``alias``.
    """
    connection = connections[alias]
    if not connection.in_atomic_block or connection.vendor == "sqlite":
        return alias
    independent = alias + _SUFFIX
    opened: set[str] = _opened.__dict__.setdefault("aliases", set())
    if independent not in opened:
        # Registered for this thread only (not in DATABASES), so the ORM and
        # transaction.atomic() can address it by name.
        source = idempotency_settings.INTENT_DATABASES.get(alias, alias)
        connections[independent] = connections.create_connection(source)
        opened.add(independent)
    return independent


def close_independent_connections() -> None:
    """Close this thread's independent connections (after each protected run)."""
    opened: set[str] = _opened.__dict__.get("aliases", set())
    for independent in opened:
        connections[independent].close()
        del connections[independent]
    opened.clear()


#: Isolation levels at which a row written by the second connection can
#: still be updated by the view's transaction afterwards.
_READ_COMMITTED = frozenset({"read committed", "read uncommitted"})


def snapshot_isolated(alias: str) -> str | None:
    """The isolation level of ``alias``'s open transaction if the completion would fail at it.

    Read from the server, since a project can raise it in ``OPTIONS``, with
    ``ALTER DATABASE ... SET default_transaction_isolation`` or with ``SET
    TRANSACTION`` in the view. PostgreSQL refuses to update a row changed
    since the snapshot at REPEATABLE READ and above. So does MariaDB with
    ``innodb_snapshot_isolation`` on (the default from 11.6.2); without it,
    and on MySQL, REPEATABLE READ updates the newest row version, which is
    what the completion needs. ``None`` where it works.
    """
    connection = connections[alias]
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SELECT current_setting('transaction_isolation')")
            level = str(cursor.fetchone()[0])
            return None if level in _READ_COMMITTED else level
        if not getattr(connection, "mysql_is_mariadb", False):
            return None
        cursor.execute(
            "SELECT VARIABLE_NAME, VARIABLE_VALUE FROM information_schema.SESSION_VARIABLES "
            "WHERE VARIABLE_NAME IN ('TX_ISOLATION', 'INNODB_SNAPSHOT_ISOLATION')"
        )
        values = {str(name).upper(): str(value) for name, value in cursor.fetchall()}
    level = values.get("TX_ISOLATION", "").replace("-", " ").lower()
    if values.get("INNODB_SNAPSHOT_ISOLATION", "OFF").upper() != "ON":
        return None
    return None if level in _READ_COMMITTED else level
