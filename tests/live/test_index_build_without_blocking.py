"""Migration 0007 builds its index on a large records table while claims go on.

A fresh database migrated to 0006, filled with 1.5 million records
(``INSERT ... SELECT generate_series``), and gunicorn serving this checkout.
A writer thread sends protected POSTs (a claim, the view, the completion),
one after another, each under a new key, for the whole test.

1. ``migrate django_idempotency 0007`` in a subprocess, as a deploy runs it:
   ``CREATE INDEX CONCURRENTLY``. A transaction held open meanwhile (as a
   report or ``pg_dump`` would) keeps the build in its last phase, "waiting
   for old snapshots", long enough to watch: claims complete while
   ``pg_stat_progress_create_index`` shows the build in progress, and no
   claim is ever seen waiting for a lock on the records table.
2. The same index built the way a plain ``AddIndex`` does it, ``CREATE
   INDEX`` inside the migration's transaction: the writer's next claim
   waits, ``pg_locks`` shows its RowExclusiveLock on the table not granted
   and ``pg_blocking_pids`` names the build's backend, until the
   transaction ends.

The claims' latencies in both windows are printed (docs/upgrading.md quotes
them); nothing is asserted on time.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pytest
import requests

from tests.live.server import LiveDatabase, LiveServer, live_database
from tests.live.services import require_postgres

pytestmark = [pytest.mark.postgres, pytest.mark.live]

ROWS = 1_500_000
INDEX = "idempotency_created_brin"
TABLE = "django_idempotency_record"
#: Claims the writer must complete while the concurrent build is seen in progress.
CLAIMS_DURING_BUILD = 5
WAIT = 120.0

FILL = f"""
INSERT INTO {TABLE} (tenant, operation, "key", fingerprint, state, lease_owner,
    lease_expires_at, fencing_token, provider_key, provider_operation_id, response_status,
    response_headers, response_body, response_sealed, created_at, updated_at, expires_at,
    tombstone)
SELECT '', 'POST fill', 'fill-' || n, 'v1:' || md5(n::text), 'COMPLETED', '', NULL, 1, '', '',
    201, '[]', '\\x7b7d'::bytea, false, now() - interval '1 second' * ({ROWS} - n), now(),
    now() + interval '1 day', false
FROM generate_series(1, {ROWS}) AS n
"""

#: Backends of this database waiting for a lock on the records table, and who blocks them.
WAITING_WRITERS = f"""
SELECT l.pid, l.mode, pg_blocking_pids(l.pid)
FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE NOT l.granted AND l.locktype = 'relation' AND l.relation = '{TABLE}'::regclass
  AND a.datname = current_database()
"""

BUILD_PHASE = """
SELECT p.phase FROM pg_stat_progress_create_index p
WHERE p.datid = (SELECT oid FROM pg_database WHERE datname = current_database())
"""


@dataclass
class Claim:
    started: float
    ended: float
    status: int

    @property
    def latency(self) -> float:
        return self.ended - self.started


@dataclass
class Writer:
    """Protected POSTs in a loop, each under a new key; every answer kept."""

    url: str
    claims: list[Claim] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        with requests.Session() as session:
            number = 0
            while not self.stop.is_set():
                number += 1
                started = time.monotonic()
                try:
                    response = session.post(
                        f"{self.url}/api-view/charges",
                        json={"amount": number},
                        headers={"Idempotency-Key": f"writer-{uuid.uuid4().hex}"},
                        timeout=WAIT,
                    )
                except requests.RequestException as exc:
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                    continue
                self.claims.append(Claim(started, time.monotonic(), response.status_code))

    def completed_between(self, start: float, end: float) -> list[Claim]:
        return [claim for claim in list(self.claims) if start <= claim.ended <= end]

    def completed_since(self, start: float) -> int:
        return len(self.completed_between(start, float("inf")))


@pytest.fixture
def served() -> Iterator[tuple[LiveDatabase, LiveServer, Writer]]:
    """1.5 million records at 0006, gunicorn serving them, the writer running."""
    require_postgres()
    with live_database(prefix="idem_index") as database:
        server = LiveServer(database, workers=2)
        try:
            server.migrate()
            server.manage("migrate", "django_idempotency", "0006")  # 0008, 0007 backwards
            # This checkout's claims write the columns 0008 adds, and it
            # serves the table as 0006 left it while 0007 runs: added by
            # hand, outside the migrations' record (0008 adds no index).
            database.connection.execute(
                f"ALTER TABLE {TABLE} ADD COLUMN principal_digest varchar(96) NULL, "
                "ADD COLUMN credential_digest varchar(96) NULL"
            )
            with database.connection.transaction():
                database.connection.execute(FILL)
            database.connection.execute(f"ANALYZE {TABLE}")
            server.start()
            writer = Writer(server.url)
            thread = threading.Thread(target=writer.run, name="writer", daemon=True)
            thread.start()
            try:
                yield database, server, writer
            finally:
                writer.stop.set()
                thread.join(WAIT)
        finally:
            server.stop()
            database.close_connection()
            server.cleanup_logs()


def wait_for(what: str, condition: Callable[[], Any], *, seconds: float = WAIT) -> Any:
    deadline = time.monotonic() + seconds
    while not (found := condition()):
        assert time.monotonic() < deadline, f"waited {seconds:.0f}s for {what}"
        time.sleep(0.02)
    return found


def index_definition(database: LiveDatabase) -> list[tuple[Any, ...]]:
    return database.query(
        "SELECT am.amname, i.indisvalid FROM pg_index i "
        "JOIN pg_class c ON c.oid = i.indexrelid JOIN pg_am am ON am.oid = c.relam "
        "WHERE c.relname = %s",
        [INDEX],
    )


def describe(name: str, claims: list[Claim]) -> str:
    latencies = sorted(claim.latency for claim in claims)
    if not latencies:
        return f"{name}: no claim completed"
    return (
        f"{name}: {len(latencies)} claims completed, latency median "
        f"{latencies[len(latencies) // 2] * 1000:.0f} ms, longest {latencies[-1] * 1000:.0f} ms"
    )


def test_the_concurrent_build_lets_claims_through_and_a_plain_one_blocks_them(
    served: tuple[LiveDatabase, LiveServer, Writer],
) -> None:
    database, server, writer = served
    wait_for("the writer's first claims", lambda: len(writer.claims) >= 5)
    before = list(writer.claims)

    # 1. migrate 0007 (CREATE INDEX CONCURRENTLY), a snapshot held open meanwhile.
    waiting: list[tuple[Any, ...]] = []
    done: list[BaseException | None] = []
    with psycopg.connect(database.url, connect_timeout=5) as holder:
        holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT count(*) FROM testapp_charge")  # the snapshot the build waits for

        def migrate() -> None:
            try:
                server.manage("migrate", "django_idempotency", "0007")
                done.append(None)
            except BaseException as exc:
                done.append(exc)

        started = time.monotonic()
        migration = threading.Thread(target=migrate, name="migrate", daemon=True)
        migration.start()

        def build_waits_for_the_snapshot() -> bool:
            waiting.extend(database.query(WAITING_WRITERS))
            phases = [row[0] for row in database.query(BUILD_PHASE)]
            assert not done, f"migrate ended before its build was seen: {done}"
            return "waiting for old snapshots" in phases

        wait_for("the build to wait for the open snapshot", build_waits_for_the_snapshot)
        seen_waiting = time.monotonic()

        def claims_completed_meanwhile() -> bool:
            waiting.extend(database.query(WAITING_WRITERS))
            assert database.query(BUILD_PHASE), "the build ended while a snapshot was held"
            return writer.completed_since(seen_waiting) >= CLAIMS_DURING_BUILD

        wait_for("claims during the build", claims_completed_meanwhile)
        holder.rollback()
    migration.join(WAIT)
    ended = time.monotonic()
    assert done == [None], done
    during_concurrent = writer.completed_between(started, ended)

    assert index_definition(database) == [("brin", True)]
    assert len(writer.completed_between(seen_waiting, ended)) >= CLAIMS_DURING_BUILD
    assert waiting == [], f"a claim waited for a lock during the concurrent build: {waiting}"

    # 2. The same index the way AddIndex builds it: CREATE INDEX in a transaction.
    server.manage("migrate", "django_idempotency", "0006")  # DROP INDEX CONCURRENTLY
    assert index_definition(database) == []
    with psycopg.connect(database.url, connect_timeout=5) as builder:
        build_pid = builder.info.backend_pid
        plain_started = time.monotonic()
        builder.execute(f'CREATE INDEX "{INDEX}" ON {TABLE} USING brin (created_at)')
        build_seconds = time.monotonic() - plain_started
        blocked = wait_for(
            "a claim blocked by the build's SHARE lock",
            lambda: [row for row in database.query(WAITING_WRITERS) if build_pid in row[2]],
        )
        blocked_at = time.monotonic()
        builder.commit()
    plain_ended = time.monotonic()
    wait_for("the blocked claim", lambda: writer.completed_since(plain_ended) >= 1)
    during_plain = writer.completed_between(plain_started, time.monotonic())

    assert {mode for _, mode, _ in blocked} == {"RowExclusiveLock"}
    # Nothing got through between the build and the end of its transaction.
    assert writer.completed_between(plain_started + build_seconds, blocked_at) == []
    assert writer.errors == [] and {claim.status for claim in writer.claims} == {201}

    print(
        f"\n{ROWS} records. {describe('before any build', before)}\n"
        f"concurrent build (migrate 0007, {ended - started:.1f} s including the held "
        f"snapshot): {describe('claims', during_concurrent)}\n"
        f"plain CREATE INDEX ({build_seconds * 1000:.0f} ms to build, lock held until "
        f"commit): {describe('claims', during_plain)}"
    )
