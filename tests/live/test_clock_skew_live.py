"""Leases and retention are judged by the database's clock.

Real processes, each with a clock of its own (libfaketime, see
``tests/live/faketime.py``), on one PostgreSQL database whose clock is true:

- gunicorn servers with a true clock, one 10 minutes ahead and one 10
  minutes behind, serving ``tests.live.clock_app`` (a protected view that
  holds its first execution until the test releases it);
- Celery workers (``tests.live.celery_app``) with a true clock and one 10
  minutes ahead, running the shipped recovery task;
- ``idempotency_purge`` run with a true clock and 3 days ahead.

The lease (``LEASE``, 60 s) is far shorter than the skew (10 minutes), so a
process that judged a lease by its own clock would find a live one run out
(the one ahead), or would write one that is out already (the one behind); a
retention of 24 hours judged 3 days ahead has run out for every record. The
tests assert that none of it happens: a duplicate answers 409 and never runs
the view nor takes the record over (its fencing token stays 1); recovery
takes nothing; the purge deletes only what has expired by the database's
clock. Each scenario also runs with true clocks only (the ``true-clock``
cases): the control that shows the harness itself is sound.

Every server's clock is measured from inside its process (``GET
/clock/now``, the ``wall_clock`` task, the purge's first line) before it is
relied on, so that a libfaketime that did not load fails the test instead
of letting it pass with true clocks.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.live import celery_harness
from tests.live.celery_harness import (
    CeleryProcess,
    QueueClient,
    celery_environment,
    new_queue,
    wait_until,
)
from tests.live.clock_app import HOLD_DIR_ENV, HOLD_LIMIT, RELEASE_ALL, release, starts
from tests.live.faketime import offset_seconds, require_libfaketime, skewed_clock
from tests.live.processes import summary_lines
from tests.live.server import (
    KEEP_LOGS_ENV,
    REPO_ROOT,
    Lazy,
    LiveDatabase,
    LiveServer,
    Project,
    Result,
    post,
)
from tests.live.services import require_postgres

pytestmark = [pytest.mark.postgres, pytest.mark.live]

#: The idempotency lease of every process, in seconds: long enough for a
#: held owner to stay well within it, far shorter than the skew.
LEASE = 60.0
AHEAD = "+10m"
BEHIND = "-10m"
#: Past the default retention (TTL, 24 hours) of every record.
PURGE_AHEAD = "+3d"
#: How far a process's measured clock may be from the skew it was given.
CLOCK_TOLERANCE = 30.0
SETTINGS = "tests.live.clock_settings"
CLOCK_PROJECT = Project(
    settings=SETTINGS,
    app="tests.live.wsgi:application",
    ready_path="/clock/now",
    ready_statuses=(200,),
)
CHARGES = "/clock/charges"
#: gunicorn sync workers per server: a held owner takes one; the true-clock
#: server holds two owners at once in the recovery case and still answers.
WORKERS = {None: 3, AHEAD: 2, BEHIND: 2}
#: Seconds a duplicate may take to answer: a 409 is immediate; a takeover
#: runs the view (which then does not hold) and answers within it too.
ANSWER_TIMEOUT = 20.0
UNRESOLVED = ("CLAIMED", "IN_PROGRESS", "UNCERTAIN")
RESOLVED = ("COMPLETED", "FAILED")
#: The purge, run as ``python -m django`` would, printing its wall clock first.
PURGE_SCRIPT = (
    "import sys, time; print(f'wall clock {time.time()}', flush=True); "
    "from django.core.management import execute_from_command_line; "
    "execute_from_command_line(['django-admin', *sys.argv[1:]])"
)


def all_at_once(actions: list[Callable[[], None]]) -> None:
    """Run ``actions`` in threads, wait for all of them; raise the first failure.

    Starting and stopping servers one by one would cost the module seconds
    each (Django boots in every worker, graceful shutdowns wait).
    """
    with ThreadPoolExecutor(max_workers=max(1, len(actions))) as pool:
        for done in [pool.submit(action) for action in actions]:
            done.result()


def clock_name(offset: str | None) -> str:
    return "a true clock" if offset is None else f"a clock {offset} off"


def check_clock(measured: float, sent_at: float, received_at: float, offset: str | None) -> float:
    """The process's clock minus the test's; fails unless it is ``offset`` within tolerance."""
    skew = measured - (sent_at + received_at) / 2
    expected = offset_seconds(offset)
    assert abs(skew - expected) <= CLOCK_TOLERANCE, (
        f"a process meant to run with {clock_name(offset)} measured {skew:+.1f}s against the "
        f"test's clock (expected {expected:+.0f}s): libfaketime did not take effect"
    )
    return skew


# -- the deployment: one database, three gunicorn servers ------------------------------------


@dataclass
class Deployment:
    database: LiveDatabase
    root: Path
    hold_dir: Path
    servers: dict[str | None, LiveServer] = field(default_factory=dict)

    def environment(self, offset: str | None) -> dict[str, str]:
        """What every process of the deployment is given: lease, hold directory, clock."""
        return {
            "IDEMPOTENCY_TEST_LEASE": str(LEASE),
            HOLD_DIR_ENV: str(self.hold_dir),
            **skewed_clock(offset),
        }

    def starts(self, run: str) -> int:
        return len(starts(self.hold_dir, run))

    def record(self, key: str) -> dict[str, Any] | None:
        rows = self.database.query(
            "SELECT state, fencing_token, lease_owner, lease_expires_at, expires_at "
            'FROM django_idempotency_record WHERE "key" = %s',
            [key],
        )
        assert len(rows) <= 1, rows
        if not rows:
            return None
        names = ("state", "fencing_token", "lease_owner", "lease_expires_at", "expires_at")
        return dict(zip(names, rows[0], strict=True))

    def charges(self, run: str) -> int:
        return self.database.count_charges(run)

    def scalar(self, statement: str, params: list[Any] | None = None) -> Any:
        return self.database.query(statement, params or [])[0][0]

    def logs_since(self, offsets: dict[str | None, int]) -> str:
        parts = []
        for clock, server in self.servers.items():
            text = server.log_since(offsets.get(clock, 0))[-4000:]
            parts.append(f"--- gunicorn with {clock_name(clock)}, since the case began ---\n{text}")
        return "\n".join(parts)

    def log_offsets(self) -> dict[str | None, int]:
        return {clock: server.log_offset() for clock, server in self.servers.items()}


def server_starter(server: LiveServer, offset: str | None) -> Callable[[], None]:
    """Start ``server`` and check the clock of its workers."""

    def start() -> None:
        server.start()
        skew = measure_server_clock(server, offset)
        name = "true" if offset is None else offset
        summary_lines.append(f"clock skew: gunicorn meant to run {name}: {skew:+.0f}s")

    return start


def measure_server_clock(server: LiveServer, offset: str | None) -> float:
    """Ask every worker of ``server`` for its wall clock (a few requests each); the skews agree."""
    skews = []
    for _ in range(server.workers * 2):
        sent_at = time.time()
        response = requests.get(server.url + "/clock/now", timeout=10)
        received_at = time.time()
        response.raise_for_status()
        skews.append(check_clock(float(response.json()["time"]), sent_at, received_at, offset))
    return sum(skews) / len(skews)


@contextlib.contextmanager
def deployment_started() -> Iterator[Deployment]:
    url = require_postgres()
    require_libfaketime()
    root = Path(tempfile.mkdtemp(prefix="idem-clock-"))
    hold_dir = root / "holds"
    hold_dir.mkdir()
    try:
        with LiveDatabase(url, prefix="idem_clock") as database:
            deployment = Deployment(database, root, hold_dir)
            try:
                for offset in (None, AHEAD, BEHIND):
                    name = "true" if offset is None else offset
                    log_dir = root / f"gunicorn{name}"
                    log_dir.mkdir()
                    deployment.servers[offset] = LiveServer(
                        database,
                        workers=WORKERS[offset],
                        extra_env=deployment.environment(offset),
                        project=CLOCK_PROJECT,
                        log_dir=log_dir,
                    )
                deployment.servers[None].migrate()  # with a true clock: only the schema matters
                # At once: each takes seconds to boot Django in every worker.
                all_at_once(
                    [
                        server_starter(server, offset)
                        for offset, server in deployment.servers.items()
                    ]
                )
                yield deployment
            finally:
                (hold_dir / RELEASE_ALL).touch()  # no worker waits for a test that is gone
                all_at_once([server.stop for server in deployment.servers.values()])
                database.close_connection()
    finally:
        if os.environ.get(KEEP_LOGS_ENV) == "1":
            print(f"\nclock-skew logs kept in {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)


def require_deployment_services() -> None:
    require_postgres()
    require_libfaketime()


def require_worker_services() -> None:
    require_deployment_services()
    celery_harness.require_redis()


@pytest.fixture(scope="module")
def deployment() -> Iterator[Lazy[Deployment]]:
    """Started by the first ``get()`` inside a test: missing services skip or fail the test."""
    lazy = Lazy(deployment_started, require_deployment_services)
    try:
        yield lazy
    finally:
        lazy.close()


# -- Celery workers on the same database -------------------------------------------------------


class ClockWorker:
    """``celery -A tests.live.celery_app worker`` on a queue of its own, with a given clock."""

    def __init__(self, deployment: Deployment, broker: str, offset: str | None) -> None:
        self.offset = offset
        self.broker = broker
        self.queue = new_queue()
        name = "true" if offset is None else offset
        env = celery_environment(
            deployment.database,
            broker,
            self.queue,
            DJANGO_SETTINGS_MODULE=SETTINGS,
            **deployment.environment(offset),
        )
        self.process = CeleryProcess.worker(env, deployment.root / f"celery{name}.log", 1)
        self.process.command.extend(["--include", "tests.live.clock_tasks"])
        self.tasks = QueueClient(broker, self.queue, "idem-clock-client")

    def start(self) -> None:
        self.process.start_worker()
        sent_at = time.time()
        answer = self.run("tests.live.clock_tasks.wall_clock")
        skew = check_clock(answer["time"], sent_at, time.time(), self.offset)
        name = "true" if self.offset is None else self.offset
        summary_lines.append(f"clock skew: Celery worker meant to run {name}: {skew:+.0f}s")

    def run(self, task: str, timeout: float = 30.0, **kwargs: Any) -> Any:
        return self.tasks.run(task, timeout, **kwargs)

    def stop(self) -> None:
        self.process.stop()
        self.tasks.close()


@contextlib.contextmanager
def workers_started(deployment: Deployment) -> Iterator[dict[str | None, ClockWorker]]:
    broker = celery_harness.require_redis()
    workers: dict[str | None, ClockWorker] = {}
    try:
        for offset in (None, AHEAD):
            workers[offset] = ClockWorker(deployment, broker, offset)
        all_at_once([worker.start for worker in workers.values()])
        yield workers
    finally:
        all_at_once([worker.stop for worker in workers.values()])


@pytest.fixture(scope="module")
def celery_workers(
    deployment: Lazy[Deployment],
) -> Iterator[Lazy[dict[str | None, ClockWorker]]]:
    lazy = Lazy(
        lambda: workers_started(deployment.get()),
        require_worker_services,
    )
    try:
        yield lazy
    finally:
        lazy.close()


# -- a request held by its owner ------------------------------------------------------------


@dataclass
class HeldRequest:
    """A request whose view runs on ``server`` and waits, under its lease, for ``release()``."""

    deployment: Deployment
    server: LiveServer
    run: str
    key: str
    body: dict[str, Any]
    answer: Future[Result]

    @property
    def headers(self) -> dict[str, str]:
        return {"Idempotency-Key": self.key}

    def started_or_answered(self) -> bool:
        return self.deployment.starts(self.run) >= 1 or self.answer.done()

    def release(self) -> Result:
        release(self.deployment.hold_dir, self.run)
        return self.answer.result(timeout=HOLD_LIMIT + 15)


@contextlib.contextmanager
def held_requests(
    deployment: Deployment, server: LiveServer, *, external: tuple[bool, ...] = (False,)
) -> Iterator[list[HeldRequest]]:
    """Send one held request per ``external`` flag; return once every view is running.

    With ``external`` the view has called ``begin_external()``: its record
    is IN_PROGRESS. Released (if the test has not) on the way out.
    """
    with ThreadPoolExecutor(max_workers=len(external)) as pool:
        held = []
        for flag in external:
            run = f"run-{uuid.uuid4().hex[:12]}"
            body = {"run": run, "amount": 10, "hold": True, "external": flag}
            key = f"clock-{uuid.uuid4().hex}"
            answer = pool.submit(
                post, server.url + CHARGES, body, {"Idempotency-Key": key}, HOLD_LIMIT + 10
            )
            held.append(HeldRequest(deployment, server, run, key, body, answer))
        try:
            for request in held:
                wait_until(request.started_or_answered, 20, server.diagnostics)
                assert not request.answer.done(), (
                    f"the owner answered before the test released it: "
                    f"{request.answer.result().describe()}\n{server.diagnostics()}"
                )
            yield held
        finally:
            for request in held:
                release(deployment.hold_dir, request.run)


def describe_record(record: dict[str, Any] | None) -> str:
    if record is None:
        return "no record"
    return (
        f"state={record['state']} fencing_token={record['fencing_token']} "
        f"lease_owner={record['lease_owner']} lease_expires_at={record['lease_expires_at']}"
    )


# -- 1 and 2: a duplicate on a server whose clock differs from the owner's ---------------------


@pytest.mark.parametrize(
    ("owner_clock", "duplicate_clock"),
    [
        pytest.param(None, None, id="true-clocks"),
        pytest.param(None, AHEAD, id="duplicate-10m-ahead"),
        pytest.param(BEHIND, None, id="owner-10m-behind"),
    ],
)
def test_a_duplicate_answers_409_and_never_takes_over_a_live_lease(
    deployment: Lazy[Deployment], owner_clock: str | None, duplicate_clock: str | None
) -> None:
    live = deployment.get()
    owner_server, duplicate_server = live.servers[owner_clock], live.servers[duplicate_clock]
    offsets = live.log_offsets()
    problems: list[str] = []

    with held_requests(live, owner_server) as (owner,):
        record = live.record(owner.key)
        assert record is not None and record["state"] == "CLAIMED", describe_record(record)
        assert record["fencing_token"] == 1, describe_record(record)

        duplicate = post(
            duplicate_server.url + CHARGES, owner.body, owner.headers, timeout=ANSWER_TIMEOUT
        )
        during = live.record(owner.key)
        executions = live.starts(owner.run)
        if duplicate.status != 409:
            problems.append(
                f"the duplicate, on {clock_name(duplicate_clock)}, answered "
                f"{duplicate.describe()} instead of 409 (in flight)"
            )
        if executions != 1:
            problems.append(
                f"the view ran {executions} times while the owner, on {clock_name(owner_clock)}, "
                "held its lease"
            )
        if during is None or during["fencing_token"] != 1 or during["state"] != "CLAIMED":
            problems.append(
                f"the record was taken over while its lease ran: {describe_record(during)} "
                f"(before: {describe_record(record)})"
            )

        answer = owner.release()
        if answer.status != 201:
            problems.append(f"the owner answered {answer.describe()} after its release, not 201")

    retry = post(duplicate_server.url + CHARGES, owner.body, owner.headers, timeout=ANSWER_TIMEOUT)
    if not (retry.status == 201 and retry.replayed and retry.body == answer.body):
        problems.append(
            f"a retry after the owner finished answered {retry.describe()}; expected the "
            f"owner's answer replayed: {answer.describe()}"
        )
    final = live.record(owner.key)
    if final is None or final["state"] != "COMPLETED" or final["fencing_token"] != 1:
        problems.append(f"the record ended {describe_record(final)}, not COMPLETED with token 1")
    charges = live.charges(owner.run)
    if charges != 1:
        problems.append(f"{charges} charges were committed for one request, not 1")
    if live.starts(owner.run) != 1:
        problems.append(f"the view ran {live.starts(owner.run)} times in all, not once")

    assert not problems, "\n".join(["", *problems, live.logs_since(offsets)])


# -- 3: recovery on a Celery worker whose clock runs ahead --------------------------------------


@pytest.mark.parametrize("worker_clock", [None, AHEAD], ids=["true-clock", "worker-10m-ahead"])
def test_recovery_takes_over_nothing_under_a_live_lease(
    deployment: Lazy[Deployment],
    celery_workers: Lazy[dict[str | None, ClockWorker]],
    worker_clock: str | None,
) -> None:
    live = deployment.get()
    worker = celery_workers.get()[worker_clock]
    server = live.servers[None]
    offsets = live.log_offsets()
    problems: list[str] = []

    # One owner before its external call (CLAIMED), one after (IN_PROGRESS).
    with held_requests(live, server, external=(False, True)) as owners:
        before = {owner.key: live.record(owner.key) for owner in owners}
        states = [record and record["state"] for record in before.values()]
        assert states == ["CLAIMED", "IN_PROGRESS"], before
        # What a run may take: leases that ran out by the database's clock
        # (none, unless an earlier case left one behind).
        stale = live.scalar(
            "SELECT count(*) FROM django_idempotency_record "
            "WHERE state = ANY(%s) AND lease_expires_at <= statement_timestamp()",
            [list(UNRESOLVED)],
        )

        report = worker.run("django_idempotency.tasks.recover_stale_records", batch_size=100)

        taken = sum(count for name, count in report.items() if name != "stale")
        if taken != stale or report.get("stale"):
            problems.append(
                f"recovery on {clock_name(worker_clock)} reported {report}; "
                f"{stale} record(s) had a lease that ran out by the database's clock"
            )
        for owner in owners:
            after = live.record(owner.key)
            was = before[owner.key]
            assert was is not None
            if after is None or any(
                after[name] != was[name] for name in ("state", "fencing_token", "lease_owner")
            ):
                problems.append(
                    f"a record under a live lease was changed by recovery: "
                    f"{describe_record(was)} -> {describe_record(after)}"
                )
        answers = [owner.release() for owner in owners]

    for owner, answer in zip(owners, answers, strict=True):
        final = live.record(owner.key)
        if answer.status != 201:
            problems.append(f"the owner answered {answer.describe()} after its release, not 201")
        if final is None or final["state"] != "COMPLETED" or final["fencing_token"] != 1:
            problems.append(
                f"the record ended {describe_record(final)}, not COMPLETED with token 1"
            )
        if live.charges(owner.run) != 1:
            problems.append(f"{live.charges(owner.run)} charges committed for {owner.run}, not 1")

    assert not problems, "\n".join(
        ["", *problems, live.logs_since(offsets), worker.process.diagnostics(40)]
    )


# -- 4: the purge run 3 days ahead ---------------------------------------------------------------


def completed_record(live: Deployment) -> str:
    """A request answered with a true clock: a COMPLETED record, retained 24 hours. Its key."""
    key = f"clock-{uuid.uuid4().hex}"
    body = {"run": f"run-{uuid.uuid4().hex[:12]}", "amount": 5}
    answer = post(live.servers[None].url + CHARGES, body, {"Idempotency-Key": key})
    assert answer.status == 201, answer.describe()
    return key


def run_purge(live: Deployment, offset: str | None) -> tuple[int, float]:
    """``idempotency_purge`` in a process of its own with clock ``offset``: (deleted, skew)."""
    env = {**live.servers[None].environment(), **live.environment(offset)}
    env["DJANGO_SETTINGS_MODULE"] = SETTINGS
    command = [sys.executable, "-c", PURGE_SCRIPT, "idempotency_purge", "--pause-factor", "0"]
    sent_at = time.time()
    result = subprocess.run(
        command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, f"the purge failed:\n{result.stdout}\n{result.stderr}"
    clock = re.search(r"wall clock (\S+)", result.stdout)
    deleted = re.search(r"deleted (\d+) record", result.stdout)
    assert clock and deleted, result.stdout
    skew = check_clock(float(clock.group(1)), sent_at, sent_at, offset)
    return int(deleted.group(1)), skew


@pytest.mark.parametrize("purge_clock", [None, PURGE_AHEAD], ids=["true-clock", "purge-3d-ahead"])
def test_the_purge_deletes_only_what_expired_by_the_databases_clock(
    deployment: Lazy[Deployment], purge_clock: str | None
) -> None:
    live = deployment.get()
    kept = [completed_record(live) for _ in range(3)]
    expired = completed_record(live)
    live.database.query(
        "UPDATE django_idempotency_record SET expires_at = statement_timestamp() - "
        "interval '1 hour' WHERE \"key\" = %s RETURNING id",
        [expired],
    )
    total_before = live.scalar("SELECT count(*) FROM django_idempotency_record")
    expired_before = live.scalar(
        "SELECT count(*) FROM django_idempotency_record "
        "WHERE state = ANY(%s) AND expires_at <= statement_timestamp()",
        [list(RESOLVED)],
    )

    deleted, skew = run_purge(live, purge_clock)

    total_after = live.scalar("SELECT count(*) FROM django_idempotency_record")
    gone = [key for key in kept if live.record(key) is None]
    problems = []
    if deleted != expired_before or total_after != total_before - expired_before:
        problems.append(
            f"the purge with {clock_name(purge_clock)} (measured {skew:+.0f}s) deleted {deleted} "
            f"record(s): {total_before} before, {total_after} after, of which {expired_before} "
            "had expired by the database's clock"
        )
    if gone:
        problems.append(f"records within their 24-hour retention were purged: {gone}")
    if live.record(expired) is not None:
        problems.append(f"the expired record {expired} was not purged")
    assert not problems, "\n".join(problems)
