"""A rolling deploy: the previous release and this one serve the same keys at once.

A previous release (each of ``PREVIOUS_RELEASES``, extracted with ``git archive``)
migrates a fresh PostgreSQL database and is served by its own gunicorn from
its own tree; then this checkout migrates the same database (0007, and 0006
after the older release: expand only, nothing the old code reads or writes
changes meaning) and is served by a second gunicorn on another port. Both
use a six-second lease. Then, both ways (old then new, new then old):

- a key executed by one version is replayed by the other byte for byte
  (status, body, Content-Type, Location);
- other input under a used key is refused 422 by both;
- a key in flight on one version gets 409 from the other;
- the same key sent to both at the same instant runs once;
- a claim left by a worker SIGKILLed in the middle of the view (its pid read
  from the record's lease owner) is taken over by the other version once
  the lease ran out: a fresh run under the next fencing token;
- each version's ``idempotency_purge`` removes the other's records past
  retention and none of its live ones.

Which releases may serve side by side: docs/upgrading.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

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
from tests.previous_release import assert_runs_from, extract_release

pytestmark = [pytest.mark.postgres, pytest.mark.live]

#: What the previous release's gunicorn imports of its own tree.
SERVED_PATHS = [
    "django_idempotency",
    "tests/__init__.py",
    "tests/settings.py",
    "tests/configurations",
    "tests/testapp",
    "tests/live",
    "testproject/payments",
]
#: The releases that may serve beside this one (docs/upgrading.md), and their trees.
PREVIOUS_RELEASES = {
    # What is deployed now: the last commit of main before issue 16.
    "51d5e69": ("51d5e69d66140f86fad62d87d9b07abcfbcb2a32", [*SERVED_PATHS, "tests/utils.py"]),
    # The oldest supported side by side: main before issue 12 (before steps,
    # tombstones and the optimistic mode), as tests/test_upgrade_from_previous_release.py.
    "6aa1767": ("6aa1767e0fae3d80c65d497dbc22213c1101836f", SERVED_PATHS),
}
#: The test settings with a short lease, in both trees.
SETTINGS = "tests.live.celery_settings"
LEASE_SECONDS = 6
#: How long a view runs when a key must be seen in flight.
VIEW_SECONDS = 2
URL = "/api-view/charges"


@dataclass
class Deployment:
    database: LiveDatabase
    old: LiveServer
    new: LiveServer

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
    with live_database(prefix="idem_rolling") as database:
        old = LiveServer(
            database, workers=2, project=previous, extra_env={**lease, "PYTHONPATH": ""}
        )
        new = LiveServer(database, workers=2, project=project, extra_env=lease)
        try:
            assert_runs_from(release, old.environment())
            old.migrate()  # what is deployed: the previous release's schema
            new.migrate()  # the deploy's first step: this release's migrations (0007)
            applied = database.query(
                "SELECT name FROM django_migrations WHERE app = 'django_idempotency'"
            )
            assert ("0007_add_created_at_brin_index",) in applied
            old.start()
            new.start()
            yield Deployment(database, old, new)
        finally:
            for server in (old, new):
                server.stop()
            database.close_connection()


# -- helpers ----------------------------------------------------------------------------------


def key(label: str) -> str:
    return f"rolling-{label}-{uuid.uuid4().hex[:10]}"


def send(server: LiveServer, idempotency_key: str, body: dict[str, Any]) -> Result:
    return post(server.url + URL, body, {"Idempotency-Key": idempotency_key}, timeout=60)


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
    for label, first, other in deployment.servers():
        held = key(label)
        body = {"amount": 7, "note": held, "sleep": VIEW_SECONDS}
        owner = in_background(first, held, body)
        wait_until("the claim", claimed(deployment.database, held))
        conflict = answered(send(other, held, body), other)
        assert code(conflict) == (409, "idempotency_request_in_progress"), conflict.describe()
        assert conflict.headers.get("Retry-After")
        executed = answered(owner(), first)
        assert (executed.status, executed.replayed) == (201, False)
        assert_same_response(answered(send(other, held, body), other), executed)
        assert deployment.database.count_charges(held) == 1


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
        body = {"amount": 9, "note": abandoned, "sleep": VIEW_SECONDS}

        crashing = in_background(first, abandoned, body)
        wait_until("the claim", claimed(database, abandoned))
        owner = record(database, abandoned)
        # lease_owner is host:pid:thread; the pid is one of `first`'s gunicorn workers.
        pid = int(owner["lease_owner"].split(":")[1])
        os.kill(pid, signal.SIGKILL)
        crashed = crashing()
        assert crashed.error is not None or crashed.status == 502, crashed.describe()
        assert database.count_charges(abandoned) == 0  # killed before the view wrote

        early = answered(send(other, abandoned, body), other)
        assert code(early) == (409, "idempotency_request_in_progress"), early.describe()
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
