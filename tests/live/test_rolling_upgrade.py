"""A rolling deploy: the previous release and this one serve the same keys at once.

The previous release (``PREVIOUS_RELEASE``, extracted with ``git archive``)
migrates a fresh PostgreSQL database and is served by its own gunicorn from
its own tree. Then, while it serves, this checkout migrates the same
database (its migrations since that release: expand only, nothing the old
code reads or writes changes meaning). A concurrent index build among them
is held in its last phase by an open snapshot while the previous release
executes and replays keys, so those requests demonstrably ran during the
migration; without one, they are answered while ``migrate`` runs or just
after it. Then this checkout is served by a second gunicorn on another port. Both use
a six-second lease. Then, both ways (old then new, new then old):

- a key executed by one version is replayed by the other byte for byte
  (status, body, Content-Type, Location);
- other input under a used key is refused 422 by both;
- a key in flight on one version gets 409 from the other (the view held
  on a lock of the test's, not for a fixed time);
- the same key sent to both at the same instant runs once;
- a claim left by a worker SIGKILLed in the middle of the view (its pid read
  from the record's lease owner) is taken over by the other version once
  the lease ran out: a fresh run under the next fencing token;
- a record left UNCERTAIN by one version (its view failed after
  ``begin_external()``) is settled by the other version's
  ``idempotency_recover`` with that version's reconciler, which reads the
  provider key the first one stored; both versions then replay the answer;
- each version's ``idempotency_purge`` removes the other's records past
  retention and none of its live ones.

Which releases may serve side by side: docs/upgrading.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.live.server import (
    Call,
    LiveDatabase,
    LiveServer,
    Project,
    Result,
    fire_together,
    live_database,
    post,
)
from tests.live.services import require_postgres
from tests.previous_release import PREVIOUS_RELEASE, assert_runs_from, extract_release

pytestmark = [pytest.mark.postgres, pytest.mark.live]

#: What the previous release's gunicorn imports of its own tree.
SERVED_PATHS = [
    "django_idempotency",
    "tests/__init__.py",
    "tests/settings.py",
    "tests/configurations",
    "tests/testapp",
    "tests/live",
    "tests/utils.py",
    "testproject/payments",
]
#: The release that may serve beside this one (docs/upgrading.md): the one
#: tests/test_upgrade_from_previous_release.py upgrades from.
PREVIOUS_RELEASES = {"previous": (PREVIOUS_RELEASE, SERVED_PATHS)}
#: This checkout's last migration: applied once the deploy's first step is done.
LAST_MIGRATION = max(
    path.stem
    for path in (Path(__file__).resolve().parents[2] / "django_idempotency/migrations").glob(
        "0*.py"
    )
)
#: The test settings with a short lease, in both trees.
SETTINGS = "tests.live.celery_settings"
LEASE_SECONDS = 6
URL = "/api-view/charges"
#: A view that calls begin_external(), in both trees; "then": "raise" fails it after.
EXTERNAL_URL = "/api-view/external"
#: Bound on waiting for the migration (a hang, not a slow machine, gets near it).
MIGRATION_SECONDS = 120.0
#: Where an open snapshot holds a concurrent index build.
HELD_BUILD_PHASE = "waiting for old snapshots"


@dataclass
class Served:
    """The previous release's answers while this release's migrations ran."""

    executed: list[Result]
    replayed: list[Result]
    #: Whether a concurrent index build was held while the answers came.
    held_a_build: bool
    #: The build's phase after the last answer: it had not finished.
    phase_after: str


@dataclass
class Deployment:
    database: LiveDatabase
    old: LiveServer
    new: LiveServer
    during_migration: Served

    def servers(self) -> list[tuple[str, LiveServer, LiveServer]]:
        """(label, first, other): each version as the first one, the other second."""
        return [("old->new", self.old, self.new), ("new->old", self.new, self.old)]


@pytest.fixture(scope="module", params=sorted(PREVIOUS_RELEASES))
def deployment(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    require_postgres()
    commit, paths = PREVIOUS_RELEASES[request.param]
    release = extract_release(commit, paths, tmp_path_factory.mktemp(request.param))
    lease = {"IDEMPOTENCY_TEST_LEASE": str(LEASE_SECONDS)}
    project = Project(settings=SETTINGS, app="tests.live.wsgi:application", ready_path=URL)
    previous = dataclasses.replace(project, root=release)
    failures_before = request.session.testsfailed
    with live_database(prefix="idem_rolling") as database:
        old = LiveServer(
            database, workers=2, project=previous, extra_env={**lease, "PYTHONPATH": ""}
        )
        new = LiveServer(database, workers=2, project=project, extra_env=lease)
        kept = True
        try:
            assert_runs_from(release, old.environment())
            old.migrate()  # what is deployed: the previous release's schema
            old.start()
            # The deploy's first step, while the previous release serves:
            # this release's migrations since that release.
            served = migrate_while_serving(database, migrating=new, serving=old)
            applied = database.query(
                "SELECT name FROM django_migrations WHERE app = 'django_idempotency'"
            )
            assert (LAST_MIGRATION,) in applied
            new.start()
            yield Deployment(database, old, new, served)
            kept = request.session.testsfailed > failures_before
        finally:
            for server in (old, new):
                server.stop()
            database.close_connection()
            for server in (old, new):
                if kept:
                    print(f"\nlive server log kept at {server.log_path}", file=sys.stderr)
                else:
                    server.cleanup_logs()


def migrate_while_serving(
    database: LiveDatabase, *, migrating: LiveServer, serving: LiveServer
) -> Served:
    """``migrating``'s migrations, with requests to ``serving`` meanwhile.

    A transaction of the test holds a snapshot (REPEATABLE READ, on no table
    of the app's: an ALTER TABLE must not wait for it), so a concurrent
    index build stops in its last phase, "waiting for old snapshots", until
    the test has its answers; a condition, not a window of time. Without a
    concurrent build, the answers come while ``migrate`` runs or after it.
    """
    errors: list[BaseException] = []

    def run() -> None:
        try:
            migrating.migrate()
        except BaseException as exc:  # raised below
            errors.append(exc)

    with psycopg.connect(database.url, connect_timeout=5) as snapshot:
        snapshot.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        snapshot.execute("SELECT 1")  # the transaction's snapshot, and no lock
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        wait_until(
            "the migrations to end, or a concurrent build to wait for the open snapshot",
            lambda: errors or not thread.is_alive() or build_phase(database) == HELD_BUILD_PHASE,
            MIGRATION_SECONDS,
        )
        assert not errors, errors
        held_a_build = build_phase(database) == HELD_BUILD_PHASE
        executed, replayed = [], []
        for number in range(3):
            during = key(f"during-migration-{number}")
            body = {"amount": number, "note": during}
            executed.append(answered(send(serving, during, body), serving))
            replayed.append(answered(send(serving, during, body), serving))
        phase_after = build_phase(database) or "finished"
        snapshot.rollback()
        thread.join(MIGRATION_SECONDS)
    assert not thread.is_alive(), "the migration did not end once the snapshot was released"
    assert not errors, errors
    return Served(executed, replayed, held_a_build, phase_after)


def build_phase(database: LiveDatabase) -> str | None:
    """The phase of the index build on the records table; None when none runs."""
    rows = database.query(
        "SELECT phase FROM pg_stat_progress_create_index "
        "WHERE relid = to_regclass('django_idempotency_record')"
    )
    return str(rows[0][0]) if rows else None


# -- helpers ----------------------------------------------------------------------------------


def key(label: str) -> str:
    return f"rolling-{label}-{uuid.uuid4().hex[:10]}"


def send(server: LiveServer, idempotency_key: str, body: dict[str, Any], url: str = URL) -> Result:
    return post(server.url + url, body, {"Idempotency-Key": idempotency_key}, timeout=60)


def answered(result: Result, server: LiveServer) -> Result:
    assert result.error is None and result.status is not None, (
        f"{result.describe()}\n{server.diagnostics()}"
    )
    return result


def in_background(
    server: LiveServer, idempotency_key: str, body: dict[str, Any]
) -> Callable[[], Result]:
    """Send the request from a thread of its own; the function returned waits for its answer."""
    results: list[Result] = []
    thread = threading.Thread(
        target=lambda: results.append(send(server, idempotency_key, body)), daemon=True
    )
    thread.start()

    def answer() -> Result:
        thread.join(60)
        assert results, "the request did not end within 60 s"
        return results[0]

    return answer


def code(result: Result) -> tuple[int | None, str]:
    return result.status, str(json.loads(result.body).get("code"))


def assert_same_response(replay: Result, first: Result) -> None:
    assert (replay.status, replay.replayed) == (first.status, True), replay.describe()
    assert replay.body == first.body
    for header in ("Content-Type", "Location"):
        assert replay.headers.get(header) == first.headers.get(header)


def wait_until(what: str, condition: Callable[[], Any], seconds: float = 60.0) -> Any:
    deadline = time.monotonic() + seconds
    while not (found := condition()):
        assert time.monotonic() < deadline, f"waited {seconds:.0f}s for {what}"
        time.sleep(0.05)
    return found


def lease_over(database: LiveDatabase, idempotency_key: str) -> bool:
    """By the database's clock, as the servers judge it."""
    rows = database.query(
        'SELECT lease_expires_at <= now() FROM django_idempotency_record WHERE "key" = %s',
        [idempotency_key],
    )
    return bool(rows and rows[0][0])


def claimed(database: LiveDatabase, idempotency_key: str) -> Callable[[], bool]:
    return lambda: database.count_records(idempotency_key) == 1


def record(database: LiveDatabase, idempotency_key: str) -> dict[str, Any]:
    (row,) = database.records(idempotency_key)
    return row


# -- the tests ----------------------------------------------------------------------------


def test_the_previous_release_serves_while_this_release_migrates(deployment: Deployment) -> None:
    served = deployment.during_migration
    for executed, replayed in zip(served.executed, served.replayed, strict=True):
        assert (executed.status, executed.replayed) == (201, False), executed.describe()
        assert_same_response(replayed, executed)
    if served.held_a_build:
        # Answered while the build still waited: the migration was under way throughout.
        assert served.phase_after == HELD_BUILD_PHASE


def test_a_key_executed_by_one_version_is_replayed_and_refused_by_both(
    deployment: Deployment,
) -> None:
    for label, first, other in deployment.servers():
        used = key(label)
        body = {"amount": 5, "note": used}
        executed = answered(send(first, used, body), first)
        assert (executed.status, executed.replayed) == (201, False), executed.describe()

        assert_same_response(answered(send(other, used, body), other), executed)
        assert_same_response(answered(send(first, used, body), first), executed)
        for server in (first, other):
            refused = answered(send(server, used, {**body, "amount": 6}), server)
            assert code(refused) == (422, "idempotency_key_reused"), refused.describe()
        assert deployment.database.count_charges(used) == 1


def test_a_key_in_flight_on_one_version_is_refused_409_by_the_other(
    deployment: Deployment,
) -> None:
    database = deployment.database
    for label, first, other in deployment.servers():
        held = key(label)
        body = {"amount": 7, "note": held}
        # The view's INSERT of its charge waits for this lock: the key stays
        # in flight until the test lets it go, however slow the machine.
        with psycopg.connect(database.url, connect_timeout=5) as blocker:
            blocker.execute("LOCK TABLE testapp_charge IN SHARE MODE")
            owner = in_background(first, held, body)
            wait_until("the claim", claimed(database, held))
            conflict = answered(send(other, held, body), other)
            assert code(conflict) == (409, "idempotency_request_in_progress"), conflict.describe()
            assert conflict.headers.get("Retry-After")
            blocker.rollback()
        executed = answered(owner(), first)
        assert (executed.status, executed.replayed) == (201, False)
        assert_same_response(answered(send(other, held, body), other), executed)
        assert database.count_charges(held) == 1


def test_the_same_key_sent_to_both_versions_at_once_runs_once(deployment: Deployment) -> None:
    for round_number in range(8):
        raced = key(f"race{round_number}")
        body = {"amount": round_number, "note": raced}
        calls = [
            Call(server.url + URL, body, {"Idempotency-Key": raced})
            for server in (deployment.old, deployment.new) * 2
        ]
        results = fire_together(calls, timeout=60)
        outcomes = sorted(
            (result.status, result.replayed) for result in results if result.error is None
        )
        assert len(outcomes) == 4, [result.describe() for result in results]
        assert outcomes.count((201, False)) == 1, outcomes
        assert set(outcomes) <= {(201, False), (201, True), (409, False)}, outcomes
        assert deployment.database.count_charges(raced) == 1


def test_a_claim_abandoned_by_a_killed_worker_is_taken_over_by_the_other_version(
    deployment: Deployment,
) -> None:
    database = deployment.database
    for label, first, other in deployment.servers():
        abandoned = key(label)
        body = {"amount": 9, "note": abandoned}

        # The view waits on this lock in its INSERT: killed there, whatever
        # the delay between the claim and the kill.
        with psycopg.connect(database.url, connect_timeout=5) as blocker:
            blocker.execute("LOCK TABLE testapp_charge IN SHARE MODE")
            crashing = in_background(first, abandoned, body)
            wait_until("the claim", claimed(database, abandoned))
            owner = record(database, abandoned)
            view_session = wait_until("the view to wait for the lock", partial(inserting, database))
            # lease_owner is host:pid:thread; the pid is one of `first`'s gunicorn workers.
            pid = int(owner["lease_owner"].split(":")[1])
            os.kill(pid, signal.SIGKILL)
            crashed = crashing()
            assert crashed.error is not None or crashed.status == 502, crashed.describe()

            early = answered(send(other, abandoned, body), other)
            assert code(early) == (409, "idempotency_request_in_progress"), early.describe()
            blocker.rollback()
        # The killed worker's session does its INSERT, then finds its client
        # gone: its transaction never commits.
        wait_until("the killed worker's session to end", partial(gone, database, view_session))
        assert database.count_charges(abandoned) == 0

        wait_until("the lease to run out", partial(lease_over, database, abandoned))
        retry = answered(send(other, abandoned, body), other)

        assert (retry.status, retry.replayed) == (201, False), retry.describe()
        taken_over = record(database, abandoned)
        assert (taken_over["state"], taken_over["fencing_token"]) == (
            "COMPLETED",
            owner["fencing_token"] + 1,
        )
        assert database.count_charges(abandoned) == 1
        assert_same_response(answered(send(first, abandoned, body), first), retry)


def inserting(database: LiveDatabase) -> int | None:
    """The session whose INSERT of a charge waits for a lock, if any."""
    rows = database.query(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
        "AND wait_event_type = 'Lock' AND query ILIKE 'INSERT INTO \"testapp_charge\"%%'"
    )
    return int(rows[0][0]) if rows else None


def gone(database: LiveDatabase, session: int) -> bool:
    return not database.query("SELECT 1 FROM pg_stat_activity WHERE pid = %s", [session])


def test_a_record_left_uncertain_by_one_version_is_settled_by_the_others_recovery(
    deployment: Deployment,
) -> None:
    database = deployment.database
    for label, first, other in deployment.servers():
        left = key(f"recover-{label}")
        body = {"amount": 4, "then": "raise"}
        failed = answered(send(first, left, body, EXTERNAL_URL), first)
        assert failed.status == 500, failed.describe()
        uncertain = record(database, left)
        assert uncertain["state"] == "UNCERTAIN", uncertain
        # Its lease runs out (by the database's clock, as recovery judges it)
        # now rather than in LEASE_SECONDS.
        database.query(
            "UPDATE django_idempotency_record SET lease_expires_at = now() - interval '1 second' "
            'WHERE "key" = %s RETURNING id',
            [left],
        )

        report = recover(other, uncertain["operation"], by=label)

        assert "completed 1," in report, report
        settled = record(database, left)
        assert (settled["state"], settled["response_status"]) == ("COMPLETED", 201), settled
        (provider_key,) = database.query(
            'SELECT provider_key FROM django_idempotency_record WHERE "key" = %s', [left]
        )[0]
        answers = [
            answered(send(server, left, body, EXTERNAL_URL), server) for server in (first, other)
        ]
        for replay in answers:
            assert (replay.status, replay.replayed) == (201, True), replay.describe()
            assert json.loads(replay.body) == {"reconciled": provider_key, "by": label}
        assert answers[0].body == answers[1].body


def recover(server: LiveServer, operation: str, *, by: str) -> str:
    """``idempotency_recover`` in ``server``'s tree, with a reconciler for ``operation``.

    The reconciler answers with the provider key the record holds (written
    by the other version): what a real one would ask its provider about.
    """
    code = (
        "from django.core.management import call_command\n"
        "from django_idempotency.recovery import Completed, register_reconciler\n"
        f"register_reconciler({operation!r})(\n"
        f"    lambda record: Completed(201, {{'reconciled': record.provider_key, 'by': {by!r}}})\n"
        ")\n"
        "call_command('idempotency_recover')\n"
    )
    return server.manage("shell", "-c", code)


def test_each_versions_purge_removes_only_the_others_records_past_retention(
    deployment: Deployment,
) -> None:
    database = deployment.database
    written: dict[str, str] = {}
    for name, server in (("old", deployment.old), ("new", deployment.new)):
        for kind in ("live", "expired"):
            written[f"{name}-{kind}"] = written_key = key(f"purge-{name}-{kind}")
            result = answered(send(server, written_key, {"amount": 3}), server)
            assert result.status == 201
    every_key = list(written.values())

    for purger, expired in ((deployment.old, "new-expired"), (deployment.new, "old-expired")):
        database.query(
            "UPDATE django_idempotency_record SET expires_at = now() - interval '1 second' "
            'WHERE "key" = %s RETURNING id',
            [written[expired]],
        )
        purger.manage("idempotency_purge", "--pause-factor", "0")
        left = {
            row[0]
            for row in database.query(
                'SELECT "key" FROM django_idempotency_record WHERE "key" = ANY(%s)', [every_key]
            )
        }
        assert written[expired] not in left
        assert {written["old-live"], written["new-live"]} <= left
