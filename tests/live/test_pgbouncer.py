"""PgBouncer in transaction pooling: begin_external()'s pool deadlock designed out, no leaks.

Real processes: a fresh PostgreSQL database (created and migrated directly
on the server), PgBouncers of the test's own in transaction pooling
(``tests/live/pgbouncer.py``) and gunicorn (4 sync workers) whose
``DATABASE_URL`` points at PgBouncer.

1. The trap. A view inside ``begin_external()`` holds a server connection
   (its open transaction) and needs a second one for the intent. With a
   pool of 2 and 4 simultaneous such requests, the two views holding the
   pool wait for it forever: no request gets anywhere until
   ``query_wait_timeout``, then at least 3 of the 4 fail (503). With
   ``IDEMPOTENCY["INTENT_DATABASES"]`` mapping the records' alias to a
   second PgBouncer entry of the same database (a pool of its own), the
   same load runs: every request once, 201.
2. No state leaks between clients of one server connection (a pool of 1,
   so every client shares it): the ``lock_timeout`` that an
   ``optimistic`` lookup sets for its transaction is gone for the
   next client's transaction; a session-level ``SET`` would leak, and the
   control step shows the probe sees that.
3. No server-side prepared statements: after requests of every kind
   through the pool of 1, ``pg_prepared_statements`` of that one server
   connection (and of the intents' pool) is empty; a client that does
   prepare shows up there (the control).

The figures (seconds, statuses, query_wait_timeout disconnections) are
printed in pytest's terminal summary.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import requests
from django.db import connections

from django_idempotency._store.statements import statements_for
from tests.live.pgbouncer import PgBouncer, PgBouncerEntry, require_pgbouncer
from tests.live.processes import summary_lines
from tests.live.server import (
    INTENT_DATABASE_URL_ENV,
    Call,
    LiveDatabase,
    LiveServer,
    Result,
    fire_together,
    post,
)
from tests.live.services import require_postgres

pytestmark = [pytest.mark.postgres, pytest.mark.live]

WORKERS = 4
#: Smaller than the simultaneous begin_external() requests: the trap.
POOL_SIZE = 2
CONCURRENT = 4
#: Short, so that the deadlock ends quickly; the bound the docs tell you to set.
QUERY_WAIT_TIMEOUT = 2.0
#: Seconds each view holds its transaction's server connection before
#: begin_external(): every request has its claim and its first write in by then.
HOLD = 0.5
ROUNDS = 3


@pytest.fixture(scope="module")
def database() -> Iterator[LiveDatabase]:
    """A migrated database, created directly on the server (never through PgBouncer)."""
    url = require_postgres()
    require_pgbouncer()
    with LiveDatabase(url, prefix="idem_bouncer") as live:
        migration = LiveServer(live, extra_env={"DATABASE_URL": live.url})
        migration.migrate()
        migration.cleanup_logs()
        yield live


@contextlib.contextmanager
def served_through(
    database: LiveDatabase,
    *,
    pool_size: int,
    intent_pool_size: int | None,
    query_wait_timeout: float,
) -> Iterator[tuple[PgBouncer, LiveServer]]:
    """PgBouncer (with an intents' entry if ``intent_pool_size``) and gunicorn behind it."""
    intents = f"{database.name}_intents"
    entries = [PgBouncerEntry(intents, database.name, intent_pool_size)] if intent_pool_size else []
    with PgBouncer(
        pool_size=pool_size, query_wait_timeout=query_wait_timeout, entries=entries
    ) as bouncer:
        env = {
            "DATABASE_URL": bouncer.url(database.name),
            INTENT_DATABASE_URL_ENV: bouncer.url(intents) if intent_pool_size else "",
        }
        server = LiveServer(database, workers=WORKERS, extra_env=env)
        ok = False
        try:
            server.start()
            yield bouncer, server
            ok = True
        finally:
            server.stop()
            if ok:
                server.cleanup_logs()
            else:
                print(f"\ngunicorn log kept at {server.log_path}\n{bouncer.diagnostics()}")


def external_calls(server: LiveServer, label: str) -> tuple[list[Result], float, str]:
    """CONCURRENT simultaneous begin_external() requests, distinct keys: results, seconds, note."""
    note = f"{label}-{uuid.uuid4().hex[:8]}"
    calls = [
        Call(
            f"{server.url}/api-view/external",
            {"amount": 7, "hold": HOLD, "peek": False, "note": note},
            {"Idempotency-Key": f"{note}-{i}"},
        )
        for i in range(CONCURRENT)
    ]
    started = time.monotonic()
    results = fire_together(calls, timeout=60)
    return results, time.monotonic() - started, note


def charges_before_call(database: LiveDatabase) -> int:
    return int(
        database.query("SELECT count(*) FROM testapp_charge WHERE tenant = 'before-call'")[0][0]
    )


def statuses(results: list[Result]) -> Counter[Any]:
    return Counter(result.status if result.error is None else "no answer" for result in results)


def timeouts_logged(bouncer: PgBouncer) -> int:
    return bouncer.log_text().count("query_wait_timeout")


def describe(results: list[Result], server: LiveServer, bouncer: PgBouncer) -> str:
    lines = [result.describe(200) for result in results]
    return "\n".join([*lines, server.diagnostics(), bouncer.diagnostics()])


def test_begin_external_deadlocks_a_pool_its_views_hold(database: LiveDatabase) -> None:
    """Without INTENT_DATABASES: pool of 2, 4 simultaneous begin_external(): all wait, all fail."""
    with served_through(
        database, pool_size=POOL_SIZE, intent_pool_size=None, query_wait_timeout=QUERY_WAIT_TIMEOUT
    ) as (bouncer, server):
        # The deadlock needs all four requests holding or waiting for a pool
        # connection at once; a loaded machine may start one so late that an
        # earlier one finished first. Such a round proves nothing either way:
        # it is run again, at most three times (a pool that no longer
        # deadlocks answers quickly every time, and fails below).
        for _round in range(3):
            written_before = charges_before_call(database)
            results, seconds, _note = external_calls(server, "deadlock")
            if all(
                result.status is not None and result.elapsed >= QUERY_WAIT_TIMEOUT
                for result in results
            ):
                break
        counted = statuses(results)
        summary_lines.append(
            f"[pgbouncer] no intents pool, pool_size={POOL_SIZE}, {CONCURRENT} simultaneous "
            f"begin_external(): statuses {dict(counted)} in {seconds:.2f}s; "
            f"query_wait_timeout disconnections logged: {timeouts_logged(bouncer)}"
        )
        explain = describe(results, server, bouncer)
        # No request got anywhere until PgBouncer gave up on the waiting
        # clients: the two queued behind the views first, then the intent
        # of one view (whose rollback lets the other view's intent through,
        # or not, depending on the order PgBouncer times them out).
        answered = [result for result in results if result.status is not None]
        assert len(answered) == CONCURRENT, explain
        assert all(result.elapsed >= QUERY_WAIT_TIMEOUT for result in answered), explain
        failed = [result for result in answered if result.status == 503]
        assert len(failed) >= CONCURRENT - 1, explain
        assert timeouts_logged(bouncer) >= len(failed), explain
        # Only what answered 201 was written, and the pool is usable again
        # afterwards: a deadlock of the pool, not a broken set-up.
        created = CONCURRENT - len(failed)
        assert set(counted) <= {201, 503}, explain
        assert charges_before_call(database) == written_before + created, explain
        alone = post(
            f"{server.url}/api-view/charges",
            {"amount": 1, "note": "after-deadlock"},
            {"Idempotency-Key": f"after-deadlock-{uuid.uuid4().hex[:8]}"},
        )
        assert alone.status == 201, alone.describe()


def test_an_intents_pool_of_its_own_never_deadlocks(database: LiveDatabase) -> None:
    """With INTENT_DATABASES: the same load, every request once, 201."""
    with served_through(
        database,
        pool_size=POOL_SIZE,
        intent_pool_size=POOL_SIZE,
        query_wait_timeout=QUERY_WAIT_TIMEOUT,
    ) as (bouncer, server):
        for number in range(1, ROUNDS + 1):
            written_before = charges_before_call(database)
            results, seconds, note = external_calls(server, f"intents-{number}")
            counted = statuses(results)
            summary_lines.append(
                f"[pgbouncer] intents pool of {POOL_SIZE}, pool_size={POOL_SIZE}, round {number}: "
                f"{CONCURRENT} simultaneous begin_external(): statuses {dict(counted)} in "
                f"{seconds:.2f}s; query_wait_timeout disconnections: {timeouts_logged(bouncer)}"
            )
            explain = describe(results, server, bouncer)
            assert counted == Counter({201: CONCURRENT}), explain
            assert charges_before_call(database) == written_before + CONCURRENT, explain
            states = database.query(
                "SELECT state, response_status, count(*) FROM django_idempotency_record "
                'WHERE "key" LIKE %s GROUP BY state, response_status',
                [f"{note}-%"],
            )
            assert states == [("COMPLETED", 201, CONCURRENT)], explain
        assert timeouts_logged(bouncer) == 0, bouncer.diagnostics()
        # Both pools were used: the intents went through their own entry.
        stats = bouncer.stats()
        assert int(stats[f"{database.name}_intents"]["total_xact_count"]) >= CONCURRENT * ROUNDS


# -- one server connection shared by every client ---------------------------------------


@pytest.fixture(scope="module")
def shared(database: LiveDatabase) -> Iterator[tuple[PgBouncer, LiveServer]]:
    """A pool of 1 (and an intents' pool of 1): every client gets the same server connection."""
    with served_through(
        database, pool_size=1, intent_pool_size=1, query_wait_timeout=20
    ) as running:
        yield running


def through(bouncer: PgBouncer, entry: str, **options: Any) -> psycopg.Connection[Any]:
    """A client of ``entry`` through PgBouncer; no prepared statements unless asked."""
    options.setdefault("prepare_threshold", None)
    return psycopg.connect(bouncer.url(entry), autocommit=True, connect_timeout=5, **options)


def in_a_transaction(bouncer: PgBouncer, entry: str, query: str) -> tuple[Any, int]:
    """``query``'s first value and the server's backend pid, in one transaction of a new client."""
    with through(bouncer, entry) as client, client.transaction():
        value = client.execute(query).fetchone()
        pid = client.execute("SELECT pg_backend_pid()").fetchone()
    assert value is not None and pid is not None
    return value[0], int(pid[0])


def test_a_lock_timeout_set_for_one_request_never_reaches_another_client(
    database: LiveDatabase, shared: tuple[PgBouncer, LiveServer]
) -> None:
    bouncer, server = shared
    name = database.name
    default, pid = in_a_transaction(bouncer, name, "SHOW lock_timeout")
    assert default == "0"

    # Control: a session-level SET by one client is what the next client of
    # the same server connection sees. The probe can see a leak.
    with through(bouncer, name) as careless:
        careless.execute("SET lock_timeout = '4321ms'")
    leaked, same_pid = in_a_transaction(bouncer, name, "SHOW lock_timeout")
    assert (leaked, same_pid) == ("4321ms", pid)
    with through(bouncer, name) as tidy:
        tidy.execute("RESET lock_timeout")

    # An optimistic request holds the only server connection for a while (its
    # view sleeps in its transaction), then sets lock_timeout for the rest of
    # that transaction (in its record's INSERT, its last statement before the
    # COMMIT); another client queued meanwhile gets that connection as soon
    # as the request commits.
    key = f"leak-{uuid.uuid4().hex[:8]}"
    answer: list[requests.Response] = []

    def request() -> None:
        answer.append(
            requests.post(
                f"{server.url}/api-view/optimistic",
                # "hold": after its first write, inside its transaction.
                json={"amount": 1, "note": key, "hold": 1.0},
                headers={"Idempotency-Key": key},
                timeout=30,
            )
        )

    thread = threading.Thread(target=request)
    thread.start()
    try:
        in_its_view = False
        deadline = time.monotonic() + 10
        while not in_its_view and time.monotonic() < deadline:
            rows = database.query(
                "SELECT 1 FROM pg_stat_activity WHERE pid = %s AND state = 'idle in transaction'",
                [pid],
            )
            in_its_view = bool(rows)
            time.sleep(0.05)
        assert in_its_view, "the request's transaction was not seen on the one server connection"
        # Queued behind the request: served right after its COMMIT, which
        # follows the record's INSERT, the statement that sets the timeout.
        after, after_pid = in_a_transaction(bouncer, name, "SHOW lock_timeout")
    finally:
        thread.join(30)
    assert answer and answer[0].status_code == 201, answer  # its record's INSERT ran
    assert "set_config('lock_timeout'" in statements_for(connections["default"]).insert_finished
    assert after_pid == pid
    assert after == "0", f"the request's lock_timeout leaked into another client: {after}"
    summary_lines.append(
        f"[pgbouncer] pool_size=1: session SET seen by the next client: {leaked}; "
        f"an optimistic request's lock_timeout seen by the next client: {after}"
    )


def test_no_server_side_prepared_statement_is_left_on_the_pool(
    database: LiveDatabase, shared: tuple[PgBouncer, LiveServer]
) -> None:
    bouncer, server = shared
    name, intents = database.name, f"{database.name}_intents"
    tag = uuid.uuid4().hex[:8]
    # Requests of every kind, several times over: first runs, replays,
    # optimistic, begin_external() with its intent, a refusal (422).
    for number in range(3):
        key = f"prepared-{tag}-{number}"
        for path, body in (
            ("/api-view/charges", {"amount": 5, "note": key}),
            ("/api-view/optimistic", {"amount": 5, "note": key}),
            ("/api-view/external", {"amount": 5, "peek": False, "provider_id": key}),
        ):
            headers = {"Idempotency-Key": f"{key}{path}"}
            first = post(server.url + path, body, headers)
            replay = post(server.url + path, body, headers)
            reused = post(server.url + path, {**body, "amount": 6}, headers)
            assert (first.status, replay.status, reused.status) == (201, 201, 422), (
                first.describe(),
                replay.describe(),
                reused.describe(),
            )

    prepared = "SELECT count(*) FROM pg_prepared_statements"
    on_pool, pid = in_a_transaction(bouncer, name, prepared)
    on_intents, _ = in_a_transaction(bouncer, intents, prepared)
    summary_lines.append(
        f"[pgbouncer] prepared statements on the pool's server connection after 27 requests: "
        f"{on_pool}; on the intents' pool's: {on_intents}"
    )
    assert (on_pool, on_intents) == (0, 0)

    # Control: a client that prepares leaves its statement on the shared
    # server connection, where the probe sees it.
    with through(bouncer, name, prepare_threshold=0) as preparing:
        preparing.execute("SELECT %s::int", [1])
    seen, same_pid = in_a_transaction(bouncer, name, prepared)
    with through(bouncer, name) as tidy:
        tidy.execute("DEALLOCATE ALL")
    assert (seen, same_pid) == (1, pid)


def test_recovery_and_purge_commands_run_through_the_pool(
    database: LiveDatabase, shared: tuple[PgBouncer, LiveServer]
) -> None:
    """``idempotency_recover`` and ``idempotency_purge`` through the pool of 1, as cron runs them.

    Records seeded directly on the server: two stale claims, two expired outcomes.
    """
    bouncer, server = shared
    tag = uuid.uuid4().hex[:8]
    keys = [f"maintenance-{tag}-{number}" for number in range(4)]
    for key in keys:
        answer = post(
            f"{server.url}/api-view/charges", {"amount": 3, "note": key}, {"Idempotency-Key": key}
        )
        assert answer.status == 201, answer.describe()
    stale, expired = keys[:2], keys[2:]
    # An owner that died holding its claim, by the database's clock ...
    database.query(
        "UPDATE django_idempotency_record SET state = 'CLAIMED', lease_owner = 'gone:1:1', "
        "lease_expires_at = now() - interval '1 minute', response_status = NULL "
        'WHERE "key" = ANY(%s) RETURNING id',
        [stale],
    )
    # ... and outcomes past their retention.
    database.query(
        "UPDATE django_idempotency_record SET expires_at = now() - interval '1 day' "
        'WHERE "key" = ANY(%s) RETURNING id',
        [expired],
    )

    recovered = server.manage("idempotency_recover")
    purged = server.manage("idempotency_purge")
    summary_lines.append(
        f"[pgbouncer] through the pool of 1: recover: {recovered.strip().splitlines()[-1:]}; "
        f"purge: {purged.strip().splitlines()[-1:]}"
    )
    remaining = database.query(
        'SELECT "key", state FROM django_idempotency_record WHERE "key" = ANY(%s)', [keys]
    )
    assert remaining == [], (recovered, purged, remaining, bouncer.diagnostics())
