"""Records are read only where they were written, with every other read on a lagging replica.

A real streaming replica (``tests/live/replica.py``): a primary PostgreSQL
of the test's own and a hot standby made by ``pg_basebackup -R``. Django
(``tests.live.replica_settings``) has ``default`` = the primary, the
records database, and ``replica`` = the standby, with
``ReadReplicaRouter``: every read of every model goes to ``replica``,
every write to ``default``. gunicorn serves the test views over HTTP.

The database is migrated and the admin's operator created, the standby
catches up, then its replay is paused for the whole module: replication
lag that never ends. Everything the tests write afterwards exists on the
primary only, so any read of a record that went through the router would
find nothing, or an older row. The first test shows the router really
sends the views' reads to the paused standby. Then, each over HTTP or
through the management commands in their own processes:

- a retry replays the stored response (no second execution);
- a concurrent duplicate gets 409; the same key with another body, 422;
- a worker killed (SIGKILL) while holding a claim leaves a record on the
  primary only: ``idempotency_recover --dry-run`` names it as held while
  its lease runs (``recovery.leased_records``) and as stale afterwards
  (``recovery.stale_records``); ``idempotency_recover`` releases it; the
  retry runs the view once;
- ``idempotency_purge --dry-run`` counts (``purge.expired_count``) and
  ``idempotency_purge`` deletes exactly the expired records, which exist
  only on the primary, and nothing else;
- an operator logged in to the admin over HTTP finds such a record in the
  list and on its page, marks it failed (the client's retry gets that
  answer) and extends another record's retention, on the primary.

Runtime about 30-40 s on 2 cores, half of it starting the two servers, migrating and
starting gunicorn.
"""

from __future__ import annotations

import html
import os
import re
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest
import requests

from tests.live.own_postgres import OwnPostgres
from tests.live.processes import summary_lines
from tests.live.replica import Standby, replicated, require_replication_binaries
from tests.live.server import (
    DEFAULT_APP,
    Lazy,
    LiveDatabase,
    LiveServer,
    Project,
    Result,
    database_url,
    post,
)

pytestmark = [pytest.mark.postgres, pytest.mark.live]

REPLICA_PROJECT = Project(
    settings="tests.live.replica_settings",
    app=DEFAULT_APP,
    ready_path="/api-view/charges",
    ready_statuses=(200,),
)
PATH = "/api-view/charges"
WORKERS = 3
#: Seconds: longer than HOLD. (The tests end a killed worker's lease by
#: setting it on the primary, rather than waiting for it.)
LEASE = 5.0
#: The view holds a claim this long before it writes: the window in which a
#: duplicate arrives, or the worker is killed.
HOLD = 1.5
OPERATOR, PASSWORD = "operator", "replica-tests-only"
CHANGELIST = "/admin/django_idempotency/idempotencyrecord/"


@dataclass
class ReplicaStack:
    primary: OwnPostgres
    standby: Standby
    database: LiveDatabase
    server: LiveServer
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.server.url

    def on_replica(self, statement: str, params: Any = ()) -> list[tuple[Any, ...]]:
        """A query on the standby's copy of the live database."""
        url = database_url(self.standby.url(), self.database.name)
        with psycopg.connect(url, autocommit=True, connect_timeout=5) as connection:
            return connection.execute(statement, params).fetchall()

    def replica_records(self, key: str) -> int:
        rows = self.on_replica(
            'SELECT count(*) FROM django_idempotency_record WHERE "key" = %s', [key]
        )
        return int(rows[0][0])

    def manage(self, *args: str) -> str:
        return self.server.manage(*args)


def replica_stack() -> Iterator[ReplicaStack]:
    started = time.monotonic()
    timings: dict[str, float] = {}
    with replicated() as (primary, standby):
        timings["primary and standby up"] = time.monotonic() - started
        with LiveDatabase(primary.url(), prefix="idem_replica") as database:
            server = LiveServer(
                database,
                workers=WORKERS,
                project=REPLICA_PROJECT,
                extra_env={
                    "IDEMPOTENCY_TEST_REPLICA_URL": database_url(standby.url(), database.name),
                    "IDEMPOTENCY_LEASE": str(LEASE),
                    "DJANGO_SUPERUSER_PASSWORD": PASSWORD,
                },
            )
            ok = False
            try:
                step = time.monotonic()
                server.migrate()
                server.manage(
                    "createsuperuser", "--noinput", "--username", OPERATOR,
                    "--email", "operator@example.com",
                )  # fmt: skip
                timings["migrate and operator"] = time.monotonic() - step
                timings["standby catch-up"] = standby.wait_caught_up()
                timings["replay pause"] = standby.pause_replay()
                step = time.monotonic()
                server.start()
                timings["gunicorn start"] = time.monotonic() - step
                yield ReplicaStack(primary, standby, database, server, timings)
                ok = True
            finally:
                server.stop()
                database.close_connection()
                if ok:
                    server.cleanup_logs()
                else:
                    print(f"\nreplica test server log kept at {server.log_path}")
                summary_lines.append(
                    "replica: "
                    + ", ".join(f"{name} {seconds:.2f}s" for name, seconds in timings.items())
                )


@pytest.fixture(scope="module")
def replica() -> Iterator[Lazy[ReplicaStack]]:
    lazy = Lazy(contextmanager(replica_stack), require_replication_binaries)
    try:
        yield lazy
    finally:
        lazy.close()


def started(replica: Lazy[ReplicaStack]) -> ReplicaStack:
    """The stack, started by the first test (inside it: a missing binary fails the test)."""
    stack = replica.get()
    # Every test runs with replay paused: what it writes is on the primary only.
    assert stack.standby.replay_paused()
    return stack


def new_key(label: str) -> str:
    return f"replica-{label}-{uuid.uuid4().hex[:10]}"


def send(stack: ReplicaStack, key: str, body: dict[str, Any], timeout: float = 30) -> Result:
    result = post(stack.url + PATH, body, {"Idempotency-Key": key}, timeout=timeout)
    assert result.error is None or "sleep" in body, result.describe()
    return result


def explain(stack: ReplicaStack, *results: Result) -> str:
    return "\n".join([*(r.describe() for r in results), stack.server.diagnostics()])


def primary_record(stack: ReplicaStack, key: str) -> dict[str, Any]:
    records = stack.database.records(key)
    assert len(records) == 1, records
    return records[0]


# -- the setting has teeth ----------------------------------------------------------------


def test_the_views_reads_go_to_the_paused_replica(replica: Lazy[ReplicaStack]) -> None:
    stack = started(replica)
    key = new_key("teeth")
    created = send(stack, key, {"amount": 3, "note": key})
    assert created.status == 201, explain(stack, created)
    # The charge and its record are on the primary, not on the replica.
    assert stack.database.count_charges(key) == 1
    assert stack.database.count_records(key) == 1
    assert stack.replica_records(key) == 0
    # GET /api-view/charges answers Charge.objects.count(): read through the
    # router, from the replica, which has not seen the charge.
    counted = requests.get(stack.url + PATH, timeout=10)
    on_replica = int(stack.on_replica("SELECT count(*) FROM testapp_charge")[0][0])
    assert counted.json() == {"count": on_replica}
    assert on_replica < stack.database.count_charges()


# -- the protected requests ---------------------------------------------------------------


def test_a_retry_replays_the_stored_response(replica: Lazy[ReplicaStack]) -> None:
    stack = started(replica)
    key = new_key("replay")
    body = {"amount": 11, "note": key}
    first = send(stack, key, body)
    retry = send(stack, key, body)
    assert first.status == 201 and not first.replayed, explain(stack, first)
    assert retry.replayed, explain(stack, first, retry)
    assert (retry.status, retry.body) == (first.status, first.body)
    assert retry.headers.get("Location") == first.headers.get("Location")
    assert stack.database.count_charges(key) == 1
    assert primary_record(stack, key)["state"] == "COMPLETED"
    assert stack.replica_records(key) == 0


def test_a_concurrent_duplicate_gets_409(replica: Lazy[ReplicaStack]) -> None:
    stack = started(replica)
    key = new_key("busy")
    body = {"amount": 12, "note": key, "sleep": HOLD}
    results: list[Result] = []
    owner = threading.Thread(target=lambda: results.append(send(stack, key, body)))
    owner.start()
    try:
        wait_for_claim(stack, key)
        duplicate = send(stack, key, body)
    finally:
        owner.join(30)
    assert duplicate.status == 409, explain(stack, duplicate)
    assert results and results[0].status == 201, explain(stack, *results)
    retry = send(stack, key, body)
    assert retry.replayed and retry.body == results[0].body, explain(stack, retry)
    assert stack.database.count_charges(key) == 1


def test_the_same_key_with_another_body_gets_422(replica: Lazy[ReplicaStack]) -> None:
    stack = started(replica)
    key = new_key("changed")
    first = send(stack, key, {"amount": 13, "note": key})
    changed = send(stack, key, {"amount": 14, "note": key})
    assert first.status == 201, explain(stack, first)
    assert changed.status == 422, explain(stack, changed)
    assert stack.database.count_charges(key) == 1


# -- recovery and purge ---------------------------------------------------------------------


def test_recovery_settles_a_stale_record_that_only_the_primary_has(
    replica: Lazy[ReplicaStack],
) -> None:
    stack = started(replica)
    key = new_key("recover")
    pid = claim_held_by_a_worker(stack, key)
    # While its lease runs, the record is held, not stale. (A lease of a
    # minute: the command's start-up must not outlast it on a busy machine.)
    set_lease(stack, key, "60 seconds")
    held = stack.manage("idempotency_recover", "--dry-run")
    assert f"\t{key}\t" not in held, held
    assert "1 unresolved record(s) skipped: their lease still runs" in held, held
    kill_worker(stack, pid)
    set_lease(stack, key, "-1 second")  # it ran out: the worker is gone
    assert stack.replica_records(key) == 0
    listed = stack.manage("idempotency_recover", "--dry-run")
    assert f"\tCLAIMED\tPOST api-view/charges\t{key}\trelease" in listed, listed
    recovered = stack.manage("idempotency_recover")
    assert recovered.startswith("released 1,"), recovered
    assert stack.database.count_records(key) == 0
    # The killed worker wrote nothing; the retry runs the view once.
    retry = send(stack, key, {"amount": 15, "note": key})
    assert retry.status == 201 and not retry.replayed, explain(stack, retry)
    assert stack.database.count_charges(key) == 1


def test_purge_deletes_the_expired_records_only_the_primary_has(
    replica: Lazy[ReplicaStack],
) -> None:
    stack = started(replica)
    keys = [new_key(f"purge{n}") for n in range(3)]
    for key in keys:
        answer = send(stack, key, {"amount": 16, "note": key})
        assert answer.status == 201, explain(stack, answer)
    expired = keys[:2]
    # Their retention over, as the clock would end it: on the primary only.
    gone = {
        row[0]
        for row in stack.database.query(
            "UPDATE django_idempotency_record SET expires_at = now() - interval '1 hour' "
            'WHERE "key" = ANY(%s) RETURNING id',
            [expired],
        )
    }
    assert len(gone) == 2
    before = {row[0] for row in stack.database.query("SELECT id FROM django_idempotency_record")}
    counted = stack.manage("idempotency_purge", "--dry-run")
    assert counted.strip() == "2 expired record(s) would be deleted.", counted
    purged = stack.manage("idempotency_purge")
    assert purged.startswith("deleted 2 record(s)"), purged
    after = {row[0] for row in stack.database.query("SELECT id FROM django_idempotency_record")}
    assert after == before - gone
    kept = send(stack, keys[2], {"amount": 16, "note": keys[2]})
    assert kept.replayed, explain(stack, kept)


# -- the admin ----------------------------------------------------------------------------


def test_admin_actions_find_and_change_records_on_the_primary(replica: Lazy[ReplicaStack]) -> None:
    stack = started(replica)
    stuck_key, kept_key = new_key("admin-stuck"), new_key("admin-kept")
    kept = send(stack, kept_key, {"amount": 17, "note": kept_key})
    assert kept.status == 201, explain(stack, kept)
    kill_worker(stack, claim_held_by_a_worker(stack, stuck_key))
    set_lease(stack, stuck_key, "-1 second")  # it ran out: the worker is gone
    stuck, kept_record = primary_record(stack, stuck_key), primary_record(stack, kept_key)
    assert stack.replica_records(stuck_key) == stack.replica_records(kept_key) == 0

    with requests.Session() as admin:
        log_in(stack, admin)
        listed = admin.get(stack.url + CHANGELIST, params={"q": stuck_key}, timeout=10)
        # A link to its page in the results (the search box repeats the key anyway).
        change = f"{CHANGELIST}{stuck['id']}/change/"
        assert listed.status_code == 200 and f'href="{change}' in listed.text, listed.text[-2000:]
        page = admin.get(stack.url + change, timeout=10)
        assert page.status_code == 200 and stuck_key in page.text, (page.url, page.text[-2000:])

        applied = apply_action(
            stack, admin, "mark_failed", stuck["id"], {"status": "503", "body": '{"gave": "up"}'}
        )
        assert "1 record was marked failed." in applied, applied[-3000:]
        marked = primary_record(stack, stuck_key)
        assert (marked["state"], marked["response_status"]) == ("FAILED", 503), marked

        applied = apply_action(stack, admin, "extend_retention", kept_record["id"], {"hours": "72"})
        assert "1 record will be kept until" in applied, applied[-3000:]
        extended = stack.database.query(
            "SELECT expires_at > now() + interval '48 hours' FROM django_idempotency_record "
            "WHERE id = %s",
            [kept_record["id"]],
        )
        assert extended == [(True,)]

    retry = send(stack, stuck_key, stuck_body(stuck_key))
    assert (retry.status, retry.replayed) == (503, True), explain(stack, retry)
    assert b'"gave"' in retry.body
    assert stack.database.count_charges(stuck_key) == 0


# -- helpers ------------------------------------------------------------------------------


def wait_for_claim(stack: ReplicaStack, key: str, timeout: float = 10.0) -> dict[str, Any]:
    """The record a request in flight has claimed, on the primary."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        records = stack.database.records(key)
        if records and records[0]["lease_owner"]:
            return records[0]
        time.sleep(0.02)
    raise AssertionError(f"no claim for {key} within {timeout}s\n" + stack.server.diagnostics())


def stuck_body(key: str) -> dict[str, Any]:
    """A request that holds its claim until its worker is killed (30 s at most)."""
    return {"amount": 17, "note": key, "sleep": 30}


def claim_held_by_a_worker(stack: ReplicaStack, key: str) -> int:
    """Send a request that holds its claim for 30 s; the pid of the worker holding it."""
    threading.Thread(target=send, args=(stack, key, stuck_body(key), 40), daemon=True).start()
    owner = str(wait_for_claim(stack, key)["lease_owner"])
    pid = int(owner.rsplit(":", 2)[1])  # host:pid:thread
    # One of this test's own gunicorn workers, nothing else.
    assert stack.server.process is not None
    status = Path(f"/proc/{pid}/status").read_text()
    assert f"\nPPid:\t{stack.server.process.pid}\n" in status, (owner, status)
    return pid


def kill_worker(stack: ReplicaStack, pid: int) -> None:
    """SIGKILL the worker: its claim stays behind, CLAIMED, its view's writes never made."""
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.02)


def set_lease(stack: ReplicaStack, key: str, interval: str) -> None:
    """Have the record's lease end ``interval`` from now, on the primary (time passing)."""
    ended = stack.database.query(
        "UPDATE django_idempotency_record SET lease_expires_at = now() + %s::interval "
        'WHERE "key" = %s RETURNING state',
        [interval, key],
    )
    assert ended == [("CLAIMED",)], ended


def hidden_fields(page: str) -> list[tuple[str, str]]:
    """The hidden inputs of the page's forms, as a browser would send them."""
    fields = []
    for tag in re.findall(r"<input[^>]*>", page):
        if 'type="hidden"' in tag:
            name = re.search(r'name="([^"]*)"', tag)
            value = re.search(r'value="([^"]*)"', tag)
            if name:
                fields.append((html.unescape(name[1]), html.unescape(value[1] if value else "")))
    return fields


def csrf_token(page: str) -> str:
    match = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page)
    assert match, page[-2000:]
    return match[1]


def log_in(stack: ReplicaStack, admin: requests.Session) -> None:
    form = admin.get(f"{stack.url}/admin/login/", timeout=10)
    answer = admin.post(
        f"{stack.url}/admin/login/?next=/admin/",
        data={
            "username": OPERATOR,
            "password": PASSWORD,
            "csrfmiddlewaretoken": csrf_token(form.text),
        },
        timeout=10,
    )
    assert answer.url.endswith("/admin/") and "Log out" in answer.text, answer.text[-2000:]


def apply_action(
    stack: ReplicaStack, admin: requests.Session, action: str, pk: int, form: dict[str, str]
) -> str:
    """Choose ``action`` for record ``pk`` in the list, then fill and apply its page."""
    changelist = admin.get(stack.url + CHANGELIST, timeout=10)
    page = admin.post(
        stack.url + CHANGELIST,
        data={
            "action": action,
            "_selected_action": str(pk),
            "index": "0",
            "csrfmiddlewaretoken": csrf_token(changelist.text),
        },
        timeout=10,
    )
    assert page.status_code == 200 and f'name="token-{pk}"' in page.text, page.text[-3000:]
    applied = admin.post(
        stack.url + CHANGELIST, data=[*hidden_fields(page.text), *form.items()], timeout=10
    )
    assert applied.status_code == 200, applied.text[-3000:]
    return applied.text
