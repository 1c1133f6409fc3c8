"""The optimistic mode (``@idempotent(optimistic=True)``) with real processes.

gunicorn (4 workers, as for the default mode's race in test_concurrency.py)
serves tests/testapp/optimistic_live_views.py on a fresh database, once on
PostgreSQL and once on MariaDB. In this mode concurrent duplicates may each
run the view's body; exactly one commits, and the others roll back and
answer with the winner's replay, or 409 when they gave up waiting. Every
body run appends a line to a file outside any transaction, so the runs that
rolled back are counted too.

The race: rounds of 50 simultaneous POSTs with one key, against

* ``orders`` (``sleep``): the bodies overlap, then collide on the Order's
  unique number: losers fail inside the view with an IntegrityError;
* ``orders-hold`` (``hold``): the winner holds its order row for a while,
  losers wait on it inside the view;
* ``notes``: no business unique key; losers get as far as the record's
  INSERT.

Per round: one business row, written by the winner's run; no 5xx, no
domain error; one 201 without ``Idempotent-Replayed``, the others its replay
(same bytes, Content-Type, Location) or 409 with Retry-After; one record,
COMPLETED, holding those bytes; a retry replays and runs no body.

Losers that give up: on PostgreSQL, a server whose IN_FLIGHT_WAIT (the
``lock_timeout`` of the record's INSERT) is shorter than the winner holds
its record uncommitted: the duplicates whose INSERT waits on it answer
409, never 500. The view's own waits are not cut: duplicates waiting on
the winner's Order row longer than IN_FLIGHT_WAIT replay it.

The crash points (``X-Crash-At``): the worker SIGKILLed in the view, after
the record's INSERT before the COMMIT (a statement wrapper in
tests/live/hooks.py), or after the COMMIT before the response. Before the
commit nothing stays: the retry runs the view, once. After it, the retry
replays. Either way one business row, one record, one more retry replays.

Run with ``-s`` to see a line per round and the bodies run per key.
``OPTIMISTIC_ROUNDS`` (20: the first variant on PostgreSQL),
``OPTIMISTIC_SHORT_ROUNDS`` (5: the others) and ``OPTIMISTIC_CRASH_TRIALS``
(2) set the sizes.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.live.processes import summary_lines
from tests.live.server import (
    DEFAULT_APP,
    LIVE_MARIADB_URL_ENV,
    TESTS_PROJECT,
    Call,
    Lazy,
    LiveServer,
    MariaDBLiveDatabase,
    Project,
    Result,
    fire_together,
    live_server,
    post,
)
from tests.live.services import require_postgres, unavailable
from tests.live.test_concurrency import Round, explainer
from tests.testapp.optimistic_live_views import (
    ALLOW_SIGKILL_ENV,
    BODIES_RUN_LOG_ENV,
    CRASH_HEADER,
    CRASH_POINTS,
)

pytestmark = [pytest.mark.postgres, pytest.mark.live, pytest.mark.guarantees]

THREADS = 50
#: The race of the issue, 50 x 20, for the first variant on PostgreSQL;
#: the other variants and MariaDB's runs (2 to 5 s a round there) fewer,
#: to keep the CI run bounded.
ROUNDS = int(os.environ.get("OPTIMISTIC_ROUNDS", "20"))
SHORT_ROUNDS = int(os.environ.get("OPTIMISTIC_SHORT_ROUNDS", "5"))
CRASH_TRIALS = int(os.environ.get("OPTIMISTIC_CRASH_TRIALS", "2"))
#: Seconds the body waits inside its transaction, widening the race window.
SLEEP = 0.2
IN_PROGRESS = "idempotency_request_in_progress"
DEFAULT_MARIADB_URL = "mysql://root@127.0.0.1:3306/test"
VENDORS = ("postgres", "mariadb")
#: Seconds the losers' record INSERT statements wait for the winner's before they give up (409).
GIVE_UP_WAIT = 0.2
#: Seconds the winner holds its record uncommitted (or its Order row) in those tests.
GIVE_UP_HOLD = 2.0
GIVE_UP_ROUNDS = 3
#: The test project with IN_FLIGHT_WAIT from the environment.
SHORT_WAIT_PROJECT = Project(
    settings="tests.live.optimistic_settings",
    app=DEFAULT_APP,
    ready_path=TESTS_PROJECT.ready_path,
    ready_statuses=TESTS_PROJECT.ready_statuses,
)

#: bodies run per key, per (vendor, variant): printed at the end.
BODIES: dict[str, list[int]] = defaultdict(list)


# -- the deployment: a live server per vendor, its business table, its body counter ---------


def mariadb_url() -> str:
    return (
        os.environ.get(LIVE_MARIADB_URL_ENV) or os.environ.get("MARIADB_URL") or DEFAULT_MARIADB_URL
    )


def require_mariadb() -> str:
    """The MariaDB server's URL if it answers; else skip, or fail under REQUIRE_SERVICES."""
    url = mariadb_url()
    probe = MariaDBLiveDatabase(url)
    problem = None
    try:
        with probe._admin() as admin, admin.cursor() as cursor:
            cursor.execute("SELECT 1")
    except Exception as exc:  # any failure means "not reachable"
        problem = " ".join(str(exc).split()) or type(exc).__name__
    if problem is not None:
        unavailable("MariaDB", f"cannot connect to {url}: {problem}", variable="MARIADB_URL")
    return url


@dataclass
class Deployment:
    vendor: str
    server: LiveServer
    bodies_log: Path

    def bodies_run(self) -> Counter[str]:
        """Body runs per Idempotency-Key, those rolled back included."""
        try:
            lines = self.bodies_log.read_text().splitlines()
        except FileNotFoundError:
            return Counter()
        return Counter(line.split(" ", 1)[0] for line in lines if line)

    def order_runs(self, number: str) -> list[str]:
        """The committed orders' runs: one Order per number, one Charge per Order."""
        orders = self.server.database.query(
            "SELECT count(*) FROM testapp_order WHERE number = %s", [number]
        )
        runs = self.note_runs(number)
        assert int(orders[0][0]) == len(runs), f"{orders[0][0]} orders, charges of runs {runs}"
        return runs

    def note_runs(self, note: str) -> list[str]:
        """The committed Charges' runs (held in ``tenant``) for a note (an order number)."""
        rows = self.server.database.query(
            "SELECT tenant FROM testapp_charge WHERE note = %s", [note]
        )
        return [str(row[0]) for row in rows]


@contextlib.contextmanager
def deployment(
    vendor: str,
    server_url: str,
    log_dir: Path,
    project: Project = TESTS_PROJECT,
    extra_env: dict[str, str] | None = None,
) -> Iterator[Deployment]:
    bodies_log = log_dir / "bodies-run.log"
    bodies_log.touch()
    environment = {BODIES_RUN_LOG_ENV: str(bodies_log), ALLOW_SIGKILL_ENV: "1", **(extra_env or {})}
    with live_server(server_url, extra_env=environment, project=project) as server:
        yield Deployment(vendor, server, bodies_log)


@pytest.fixture(scope="module", params=VENDORS)
def optimistic(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Lazy[Deployment]]:
    """A deployment per vendor, started by the first ``get()`` inside a test."""
    vendor = str(request.param)
    require = require_postgres if vendor == "postgres" else require_mariadb
    log_dir = tmp_path_factory.mktemp(f"optimistic-{vendor}")
    lazy = Lazy(lambda: deployment(vendor, require(), log_dir), require)
    try:
        yield lazy
    finally:
        lazy.close()


@pytest.fixture(scope="module")
def short_wait(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lazy[Deployment]]:
    """PostgreSQL, IN_FLIGHT_WAIT = GIVE_UP_WAIT: the lock_timeout of the losers' INSERT."""
    log_dir = tmp_path_factory.mktemp("optimistic-short-wait")
    environment = {"IDEMPOTENCY_IN_FLIGHT_WAIT": str(GIVE_UP_WAIT)}
    lazy = Lazy(
        lambda: deployment(
            "postgres", require_postgres(), log_dir, SHORT_WAIT_PROJECT, environment
        ),
        require_postgres,
    )
    try:
        yield lazy
    finally:
        lazy.close()


@pytest.fixture(scope="module", autouse=True)
def print_bodies_run() -> Iterator[None]:
    yield
    for label, counts in BODIES.items():
        line = (
            f"[optimistic {label}] bodies run per key over {len(counts)} keys: "
            f"min={min(counts)} median={statistics.median(counts):g} max={max(counts)} "
            f"total={sum(counts)} histogram={dict(sorted(Counter(counts).items()))}"
        )
        print(line)
        summary_lines.append(line)


# -- the race -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    label: str
    path: str
    #: The request body for a round's business identifier.
    body: Callable[[str], dict[str, Any]]
    #: The committed business rows' runs for that identifier.
    rows: Callable[[Deployment, str], list[str]]


VARIANTS = (
    Variant(
        "orders",
        "/optimistic/orders",
        lambda ident: {"order": ident, "amount": 100, "sleep": SLEEP},
        Deployment.order_runs,
    ),
    Variant(
        "orders-hold",
        "/optimistic/orders",
        lambda ident: {"order": ident, "amount": 100, "hold": SLEEP},
        Deployment.order_runs,
    ),
    Variant(
        "notes",
        "/optimistic/notes",
        lambda ident: {"order": ident, "amount": 100, "sleep": SLEEP},
        Deployment.note_runs,
    ),
)


def storm_round(running: Deployment, variant: Variant, number: int) -> tuple[Round, int]:
    """One round of THREADS simultaneous duplicates; its answers and the bodies run."""
    server = running.server
    tag = f"{variant.label}-{server.run_id}-{number}-{uuid.uuid4().hex[:8]}"
    key, ident = f"opt-{tag}", f"ident-{tag}"
    body = variant.body(ident)
    url = server.url + variant.path
    headers = {"Idempotency-Key": key}
    log_offset = server.log_offset()

    started = time.monotonic()
    results = fire_together([Call(url, body, headers)] * THREADS)
    elapsed = time.monotonic() - started
    committed = variant.rows(running, ident)
    bodies = running.bodies_run()[key]
    storm = Round(
        label=f"{running.vendor} {variant.label}",
        number=number,
        key=key,
        note=ident,
        results=results,
        executions=len(committed),
        elapsed=elapsed,
    )
    print(f"{storm.line()} bodies-run={bodies}")
    explain = explainer(server, storm, log_offset)

    assert not storm.exceptions, explain("requests failed without an HTTP answer")
    assert not storm.server_errors, explain("5xx answers")
    assert not storm.other, explain("answers that are neither 201 nor 409")
    assert len(committed) == 1, explain(f"{len(committed)} business rows committed, not one")
    assert 1 <= bodies <= THREADS, explain(f"{bodies} bodies run")
    assert len(storm.first) == 1, explain(
        f"{len(storm.first)} answers are 201 without Idempotent-Replayed, not exactly one"
    )
    original = storm.first[0]
    assert json.loads(original.body)["run"] == committed[0], explain(
        "the original 201 is not from the run that committed"
    )
    assert original.headers.get("Idempotency-Key") == key, explain("the key is not echoed")
    for replay in storm.replayed:
        assert replay.headers.get("Idempotent-Replayed") == "true", explain(replay.describe())
        assert replay.body == original.body, explain(f"a replay differs: {replay.describe()}")
        for name in ("Content-Type", "Location", "Idempotency-Key"):
            assert replay.headers.get(name) == original.headers.get(name), explain(
                f"a replay's {name} differs: {replay.describe()}"
            )
    for conflict in storm.conflicts:
        assert json.loads(conflict.body).get("code") == IN_PROGRESS, explain(conflict.describe())
        assert conflict.headers.get("Retry-After", "").isdigit(), explain(conflict.describe())

    records = server.database.records(key)
    assert len(records) == 1, explain(f"{len(records)} records for the key, not one")
    assert (records[0]["state"], records[0]["response_status"]) == ("COMPLETED", 201), explain(
        "the record is not COMPLETED with 201"
    )
    assert bytes(records[0]["response_body"]) == original.body, explain(
        "the stored body is not the bytes the first client received"
    )

    final = post(url, body, headers)
    assert final.status == 201 and final.replayed, explain(f"the retry got {final.describe()}")
    assert final.body == original.body, explain(f"the retry's body differs: {final.describe()}")
    assert variant.rows(running, ident) == committed, explain("the retry wrote")
    assert running.bodies_run()[key] == bodies, explain("the retry ran the body")
    assert not server.problems_since(log_offset), explain("the server logged errors this round")
    return storm, bodies


@pytest.mark.parametrize("variant", VARIANTS, ids=[variant.label for variant in VARIANTS])
def test_fifty_simultaneous_duplicates_commit_once(
    optimistic: Lazy[Deployment], variant: Variant
) -> None:
    """Rounds of 50 same-key POSTs: one commit, the winner's answer for all (or 409)."""
    running = optimistic.get()
    full = running.vendor == "postgres" and variant is VARIANTS[0]
    for number in range(1, (ROUNDS if full else SHORT_ROUNDS) + 1):
        _, bodies = storm_round(running, variant, number)
        BODIES[f"{running.vendor} {variant.label}"].append(bodies)


def test_losers_that_give_up_waiting_answer_409(short_wait: Lazy[Deployment]) -> None:
    """The winner holds its record uncommitted past IN_FLIGHT_WAIT: waiting duplicates get 409."""
    running = short_wait.get()
    variant = Variant(
        "notes-give-up",
        "/optimistic/notes",
        lambda ident: {"order": ident, "amount": 100, "hold_after_record_insert": GIVE_UP_HOLD},
        Deployment.note_runs,
    )
    conflicts = 0
    for number in range(1, GIVE_UP_ROUNDS + 1):
        storm, bodies = storm_round(running, variant, number)
        BODIES[f"{running.vendor} {variant.label}"].append(bodies)
        conflicts += len(storm.conflicts)
    # Every round, the other workers' duplicates reach their INSERT meanwhile.
    assert conflicts > 0, "no duplicate gave up waiting: the INSERT's lock_timeout is not in force"


def test_losers_waiting_on_the_winners_order_row_are_not_cut(short_wait: Lazy[Deployment]) -> None:
    """The winner holds its Order row past IN_FLIGHT_WAIT: the duplicates wait, then replay."""
    running = short_wait.get()
    variant = Variant(
        "orders-held-long",
        "/optimistic/orders",
        lambda ident: {"order": ident, "amount": 100, "hold": GIVE_UP_HOLD},
        Deployment.order_runs,
    )
    for number in range(1, GIVE_UP_ROUNDS + 1):
        storm, bodies = storm_round(running, variant, number)
        BODIES[f"{running.vendor} {variant.label}"].append(bodies)
        assert not storm.conflicts, f"{len(storm.conflicts)} duplicates were cut at IN_FLIGHT_WAIT"


# -- the crash points -----------------------------------------------------------------------

#: How long a trial may take to get an answer after its kill (worker restarts).
SETTLE_DEADLINE = 30.0


def settle(url: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[Result, int]:
    """Retry until the answer is neither a dropped connection nor a 409; and how many."""
    deadline = time.monotonic() + SETTLE_DEADLINE
    attempts = 0
    while True:
        attempts += 1
        answer = post(url, body, headers)
        if (answer.error is None and answer.status != 409) or time.monotonic() > deadline:
            return answer, attempts
        time.sleep(0.2)


@pytest.mark.parametrize("point", CRASH_POINTS)
@pytest.mark.parametrize("variant", (VARIANTS[0], VARIANTS[2]), ids=lambda variant: variant.label)
def test_a_killed_worker_leaves_one_outcome(
    optimistic: Lazy[Deployment], variant: Variant, point: str
) -> None:
    """SIGKILL at a crash point; the retries run the view once in all, or replay."""
    running = optimistic.get()
    server = running.server
    committed_before_kill = point == "after-commit"
    for trial in range(CRASH_TRIALS):
        tag = f"{point}-{variant.label}-{server.run_id}-{trial}-{uuid.uuid4().hex[:8]}"
        key, ident = f"crash-{tag}", f"ident-{tag}"
        body = {**variant.body(ident), "sleep": 0}
        url = server.url + variant.path
        headers = {"Idempotency-Key": key}

        crash = post(url, body, {**headers, CRASH_HEADER: point})
        retry, attempts = settle(url, body, headers)
        again = post(url, body, headers)

        committed = variant.rows(running, ident)
        records = server.database.records(key)
        bodies = running.bodies_run()[key]
        context = (
            f"trial {tag}: crash={crash.describe()} retry ({attempts} attempts)="
            f"{retry.describe()} again={again.describe()} committed={committed} "
            f"bodies={bodies} records={records}\n{server.diagnostics()}"
        )
        assert crash.error is not None, f"the worker did not die: {context}"
        assert retry.status == 201, f"the retry did not settle on 201: {context}"
        assert retry.replayed is committed_before_kill, (
            "a retry after the commit must replay, before it must run the view: " + context
        )
        assert len(committed) == 1, f"{len(committed)} business rows, not one: {context}"
        assert json.loads(retry.body)["run"] == committed[0], context
        assert bodies == (1 if committed_before_kill else 2), f"bodies run: {context}"
        assert len(records) == 1 and records[0]["state"] == "COMPLETED", context
        assert bytes(records[0]["response_body"]) == retry.body, context
        assert again.status == 201 and again.replayed and again.body == retry.body, context
    line = (
        f"[optimistic {running.vendor} {variant.label}] crash {point}: "
        f"{CRASH_TRIALS} trials, one business row each, "
        f"retry {'replayed' if committed_before_kill else 'ran the view once more'}"
    )
    print(line)
    summary_lines.append(line)
