"""The record store goes away under load and comes back: 503 (or FAIL_OPEN), then no stuck record.

Each test starts a PostgreSQL server of its own (``own_postgres.py``: initdb
into a temporary directory, its own port; the machine's shared server is
never touched), migrates it, and starts gunicorn (3 sync workers) with
``tests.live.outage_settings`` (``tests.settings`` plus ``IDEMPOTENCY``
from the environment, and a 3 s lease). Client threads then POST to the
``@api_view`` test view ``/api-view/charges``, 6 threads with a 50 ms
pause each: mostly new keys, about a third keys sent before (a retry, the
same body). The body's ``note`` is
the key, so the Charge rows count the executions per key.

Timeline: load for a while, ``pg_ctl stop`` in the middle of it, load on
for a few seconds with the server down, ``pg_ctl start``, load on for
longer than the lease. Then one recovery run
(``manage.py idempotency_recover``), and a last delivery of every key that
has not had its 201 yet (what a client that retries until it gets an
answer ends with).

Every request is put in a phase by its start and end times:

- ``before`` / ``after``: ended before the stop began / started after the
  restart finished;
- ``outage``: started after the server was gone, ended before it was
  started again;
- ``stopping`` / ``restarting``: in flight while the server was stopped /
  started (straddling).

Fail-closed (the default; one database for everything, stopped with
``-m immediate``, as in a crash):

- every ``outage`` request gets 503 ``idempotency_store_unavailable`` with
  ``Retry-After`` and a DRF error body, no traceback in it, and one
  "refusing ... with 503" log line per request;
- no 500 at all: a request in flight at the very moment the server died
  (its claim committed, then the view's own write, the outcome or the
  commit lost the connection) gets 503 too, with a Retry-After of the
  lease, since its claim stays until the lease ends; the layer logs that
  it could not release that claim, and the record it left CLAIMED must be
  taken over by a retry after the lease or released by the recovery run
  (500s in that phase are still tolerated, for failures outside the layer);
- this works with ``tests.settings``' middleware as it is: the session and
  authentication middleware are lazy, and the clients send no session
  cookie and no token (DRF's ``AllowAny``), so the claim is the request's
  first database access. A 500 during the outage would show it is not;
- afterwards: no CLAIMED, IN_PROGRESS or UNCERTAIN record; every key has
  exactly one record (COMPLETED, 201), exactly one Charge, exactly one
  non-replayed 201; every replay has the original's status, body bytes,
  Content-Type and Location.

FAIL_OPEN (``IDEMPOTENCY["FAIL_OPEN"] = True``). If the one database went
down, the view's own write would fail too, and FAIL_OPEN would prove
nothing but a 500. So the records live on a database of their own
(``IDEMPOTENCY["DATABASE"] = "records"``, a second own PostgreSQL server,
the one that is stopped, here with ``-m fast``), while the view writes to
``default`` on a first own server that stays up, with ``ATOMIC_REQUESTS``:
the protected run then opens the view's transaction on both, the records'
block inside, so a failure to store the outcome rolls the view's writes
back. Expected:

- every ``outage`` request runs the view: a 201 that is not a replay, a
  new Charge, and one "FAIL_OPEN runs ... unprotected" warning in the log
  naming its key;
- per key: Charges == non-replayed 201s == FAIL_OPEN warnings + records
  (0 or 1: the one protected execution, its record COMPLETED). A key sent
  only while the store was down has no record: it ran unprotected only.
  Keys never sent while the store was down executed exactly once. More than
  one execution of a key sent during the outage is FAIL_OPEN's documented
  price, counted in the summary;
- replays are identical to the stored (protected) response; nothing stuck.

A summary per variant (requests, answers per phase, executions per key,
records left before and after the recovery run, what the log says, the
time each step took) goes to pytest's terminal summary, under "live tests:
results", passed or failed. Runtime about 25-30 s per variant.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.live.own_postgres import OwnPostgres, require_own_postgres
from tests.live.processes import summary_lines
from tests.live.server import DEFAULT_APP, LiveDatabase, LiveServer, Project

pytestmark = [pytest.mark.postgres, pytest.mark.live]

OUTAGE_PROJECT = Project(
    settings="tests.live.outage_settings",
    app=DEFAULT_APP,
    ready_path="/api-view/charges",
    ready_statuses=(200,),
)
PATH = "/api-view/charges"
OPERATION = "POST api-view/charges"
WORKERS = 3
CLIENT_THREADS = 6
#: Share of requests that send an earlier key again (a retry).
RETRY_SHARE = 0.35
#: Seconds each client waits between its requests.
PAUSE = 0.05
LEASE = 3.0
BEFORE = 2.5
OUTAGE = 4.0
#: Longer than the lease: a claim left behind by the stop is taken over.
AFTER = LEASE + 2.0
REQUEST_TIMEOUT = 20.0
UNAVAILABLE = "idempotency_store_unavailable"
UNCERTAIN = "idempotency_outcome_uncertain"
IN_PROGRESS = "idempotency_request_in_progress"
UNRESOLVED = ("CLAIMED", "IN_PROGRESS", "UNCERTAIN")
TRACEBACK_MARKERS = ("Traceback", 'File "', "psycopg", "OperationalError")


# -- the load -----------------------------------------------------------------------------


@dataclass
class Sent:
    """One POST and its answer."""

    key: str
    started: float
    ended: float = 0.0
    status: int | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    body: bytes = b""
    error: str | None = None
    final: bool = False
    phase: str = ""

    @property
    def replayed(self) -> bool:
        return self.headers.get("Idempotent-Replayed") == "true"

    @property
    def first_201(self) -> bool:
        return self.status == 201 and not self.replayed

    def describe(self) -> str:
        interesting = {
            name: value
            for name, value in self.headers.items()
            if name.lower()
            in {"content-type", "location", "retry-after", "idempotent-replayed", "idempotency-key"}
        }
        return (
            f"[{self.phase}] key={self.key} status={self.status} error={self.error} "
            f"{interesting} {self.body[:300]!r}"
        )


def body_for(key: str) -> dict[str, Any]:
    return {"amount": 100 + sum(key.encode()) % 900, "note": key}


def send(session: requests.Session, url: str, key: str, *, final: bool = False) -> Sent:
    sent = Sent(key=key, started=time.monotonic(), final=final)
    try:
        response = session.post(
            url, json=body_for(key), headers={"Idempotency-Key": key}, timeout=REQUEST_TIMEOUT
        )
        sent.status = response.status_code
        sent.headers = dict(response.headers)
        sent.body = response.content
        response.close()
    except requests.RequestException as exc:
        sent.error = f"{type(exc).__name__}: {exc}"
    sent.ended = time.monotonic()
    return sent


class Load:
    """Client threads POSTing new keys and retries until stopped."""

    def __init__(self, url: str, label: str, seed: int) -> None:
        self.url = url + PATH
        self.label = label
        self.seed = seed
        self.results: list[Sent] = []
        self.keys: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._counter = 0

    def _new_key(self) -> str:
        with self._lock:
            self._counter += 1
            key = f"outage-{self.label}-{self._counter:05d}-{uuid.uuid4().hex[:8]}"
            self.keys.append(key)
            return key

    def _pick_key(self, rng: random.Random) -> str:
        with self._lock:
            known = len(self.keys)
            if known and rng.random() < RETRY_SHARE:
                return self.keys[rng.randrange(known)]
        return self._new_key()

    def _run(self, number: int) -> None:
        rng = random.Random(self.seed * 1000 + number)
        with requests.Session() as session:
            while not self._stop.is_set():
                sent = send(session, self.url, self._pick_key(rng))
                with self._lock:
                    self.results.append(sent)
                time.sleep(PAUSE)

    def start(self) -> None:
        for number in range(CLIENT_THREADS):
            thread = threading.Thread(
                target=self._run, args=(number,), name=f"outage-load-{number}", daemon=True
            )
            self._threads.append(thread)
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(REQUEST_TIMEOUT + 10)
        assert not any(thread.is_alive() for thread in self._threads), "a client thread hung"


@dataclass
class Timeline:
    stop_issued: float = 0.0
    stop_done: float = 0.0
    start_issued: float = 0.0
    start_done: float = 0.0

    def phase(self, sent: Sent) -> str:
        if sent.final:
            return "final"
        if sent.ended <= self.stop_issued:
            return "before"
        if sent.started >= self.start_done:
            return "after"
        if sent.started >= self.stop_done and sent.ended <= self.start_issued:
            return "outage"
        if sent.started < self.stop_done:
            return "stopping"
        return "restarting"


def run_outage(
    server: LiveServer, store: OwnPostgres, *, label: str, mode: str, seed: int
) -> tuple[list[Sent], list[str], Timeline]:
    """The load with a stop and a restart of ``store`` in its middle."""
    load = Load(server.url, label, seed)
    timeline = Timeline()
    load.start()
    try:
        time.sleep(BEFORE)
        timeline.stop_issued = time.monotonic()
        store.stop(mode)
        timeline.stop_done = time.monotonic()
        time.sleep(OUTAGE)
        timeline.start_issued = time.monotonic()
        store.start()
        timeline.start_done = time.monotonic()
        time.sleep(AFTER)
    finally:
        load.stop()
    for sent in load.results:
        sent.phase = timeline.phase(sent)
    return load.results, load.keys, timeline


def deliver_all(server: LiveServer, keys: list[str]) -> list[Sent]:
    """Each key once more: the answer a client that retries until it has one gets."""
    url = server.url + PATH

    def one(key: str) -> Sent:
        with requests.Session() as session:
            sent = send(session, url, key, final=True)
            sent.phase = "final"
            return sent

    with ThreadPoolExecutor(max_workers=CLIENT_THREADS) as pool:
        return list(pool.map(one, keys))


# -- checks -------------------------------------------------------------------------------


def scope_pattern(message: str) -> re.Pattern[str]:
    """A log message naming a scope; group 1 is the key."""
    scope = re.escape(f"Scope(tenant='anonymous', operation='{OPERATION}', key='") + r"([^']+)'\)"
    return re.compile(message.replace("SCOPE", scope).replace(".*?", r"[\s\S]*?"))


#: A claim refused because the store is unreachable (never under FAIL_OPEN).
REFUSED_AT_CLAIM = scope_pattern(r"Idempotency store unreachable \(.*?\); refusing SCOPE with 503")
#: Every 503 is logged with its scope: refused at the claim, or the store lost
#: while the view ran or committed (then the outcome may be uncertain), which
#: FAIL_OPEN cannot help once the view has started.
REFUSED = scope_pattern(
    r"(?:Idempotency store unreachable \(.*?\); refusing "
    r"|Idempotency store lost during "
    r"|Could not record the outcome of "
    r"|Could not learn whether )SCOPE"
)
FAIL_OPEN_RUN = scope_pattern(r"Idempotency store unreachable \(.*?\); FAIL_OPEN runs SCOPE")
NOT_RELEASED = scope_pattern(r"Could not (?:release the claim on|mark) SCOPE")
TOOK_OVER = scope_pattern(r"Took over record \d+ \(SCOPE\)")


def keys_logged(pattern: re.Pattern[str], log: str) -> Counter[str]:
    return Counter(match.group(1) for match in pattern.finditer(log))


def check_unavailable_answer(sent: Sent) -> list[str]:
    """What is wrong with a 503 answer, if anything."""
    problems = []
    try:
        payload = json.loads(sent.body)
    except ValueError:
        return [f"503 body is not JSON: {sent.describe()}"]
    # A store lost while the request committed cannot say "not run".
    if payload.get("code") not in (UNAVAILABLE, UNCERTAIN) or not payload.get("detail"):
        problems.append(f"503 body is not DRF's error shape with {UNAVAILABLE}: {sent.describe()}")
    retry_after = sent.headers.get("Retry-After", "")
    if not retry_after.isdigit() or int(retry_after) <= 0:
        problems.append(f"503 without a positive Retry-After: {sent.describe()}")
    if not sent.headers.get("Content-Type", "").startswith("application/json"):
        problems.append(f"503 not JSON: {sent.describe()}")
    return problems


def traceback_in_body(sent: Sent) -> bool:
    text = sent.body.decode("utf-8", "replace")
    return any(marker in text for marker in TRACEBACK_MARKERS)


def server_errors(log: str) -> list[str]:
    """Each logged "Internal Server Error", described by its traceback.

    The project's own frames (the view, the idempotency layer) in the order
    they appear, the first error (the root cause) and the last one.
    """
    described = []
    for block in re.split(r"\n(?=\[\d+\] \[ERROR\] django\.request: )", log):
        if "Internal Server Error" not in block.splitlines()[0]:
            continue
        lines = [block.splitlines()[0]]
        for line in block.splitlines()[1:]:
            if line.startswith(("access ", "[", "Idempotency store", "Could not", "Took over")):
                break
            lines.append(line)
        text = "\n".join(lines)
        own: list[str] = []
        for path, function in re.findall(r'File "([^"]+)", line \d+, in (\w+)', text):
            if "/django_idempotency/" in path or "/tests/" in path:
                frame = f"{'/'.join(path.split('/')[-2:])}:{function}"
                if frame not in own:
                    own.append(frame)
        errors = re.findall(r"^((?:\w+\.)*\w*(?:Error|Exception)\b.*)$", text, re.MULTILINE)
        described.append(
            f"own frames {own}; root cause {errors[0][:110] if errors else '?'!r}; "
            f"raised {errors[-1][:110] if errors else '?'!r}"
        )
    return described


@dataclass
class Outcome:
    """Everything a variant measured, for the assertions and the summary."""

    label: str
    results: list[Sent]
    final: list[Sent]
    keys: list[str]
    timeline: Timeline
    log: str
    recovery_output: str
    stuck_before_recovery: list[tuple[Any, ...]]
    stuck_after_recovery: list[tuple[Any, ...]]
    records: dict[str, list[tuple[Any, ...]]]
    charges: Counter[str]
    elapsed: float
    steps: dict[str, float] = field(default_factory=dict)

    def responses(self) -> dict[str, list[Sent]]:
        """Every answer per key, in the order sent."""
        by_key: dict[str, list[Sent]] = defaultdict(list)
        for sent in sorted([*self.results, *self.final], key=lambda s: s.started):
            by_key[sent.key].append(sent)
        return by_key

    def by_phase(self) -> dict[str, Counter[str]]:
        table: dict[str, Counter[str]] = defaultdict(Counter)
        for sent in [*self.results, *self.final]:
            if sent.error is not None:
                kind = "exception"
            elif sent.first_201:
                kind = "201"
            elif sent.status == 201:
                kind = "201-replay"
            else:
                kind = str(sent.status)
            table[sent.phase][kind] += 1
        return table

    def summary(self) -> list[str]:
        every = [*self.results, *self.final]
        statuses = Counter(
            "exception"
            if s.error
            else "201-replay"
            if s.status == 201 and s.replayed
            else str(s.status)
            for s in every
        )
        usual = {"201", "201-replay", "503", "409", "500"}
        other = sum(count for kind, count in statuses.items() if kind not in usual)
        retried = [key for key, n in Counter(s.key for s in self.results).items() if n > 1]
        executions = Counter(self.charges[key] for key in self.keys)
        outage_seconds = self.timeline.start_done - self.timeline.stop_issued
        lines = [
            f"[{self.label}] requests sent: {len(self.results)} during the load "
            f"+ {len(self.final)} final deliveries; keys: {len(self.keys)}, "
            f"{len(retried)} of them sent more than once during the load",
            f"[{self.label}] answers: 201 (first) {statuses['201']}, replays "
            f"{statuses['201-replay']}, 503 {statuses['503']}, 409 {statuses['409']}, "
            f"500 {statuses['500']}, other {other}",
            f"[{self.label}] store down for {outage_seconds:.2f}s "
            f"(stop {self.timeline.stop_done - self.timeline.stop_issued:.2f}s, restart "
            f"{self.timeline.start_done - self.timeline.start_issued:.2f}s)",
        ]
        for phase in ("before", "stopping", "outage", "restarting", "after", "final"):
            counts = self.by_phase().get(phase, Counter())
            lines.append(
                f"[{self.label}]   {phase:>10}: "
                + (", ".join(f"{k} x{v}" for k, v in sorted(counts.items())) or "-")
            )
        lines += [
            f"[{self.label}] executions per key (Charges): "
            + ", ".join(
                f"{n} execution(s): {count} keys" for n, count in sorted(executions.items())
            ),
            f"[{self.label}] unresolved records before recovery: {len(self.stuck_before_recovery)}"
            f" {[row[1] for row in self.stuck_before_recovery]}; recovery: "
            f"{self.recovery_output.strip()}; stuck after recovery: "
            f"{len(self.stuck_after_recovery)}",
            f"[{self.label}] log: {sum(keys_logged(REFUSED, self.log).values())} '503' errors, "
            f"{sum(keys_logged(FAIL_OPEN_RUN, self.log).values())} FAIL_OPEN warnings, "
            f"{sum(keys_logged(NOT_RELEASED, self.log).values())} 'could not release', "
            f"{sum(keys_logged(TOOK_OVER, self.log).values())} takeovers, "
            f"{self.log.count('Internal Server Error')} server errors; "
            f"variant took {self.elapsed:.1f}s ("
            + ", ".join(f"{name} {seconds:.1f}s" for name, seconds in self.steps.items())
            + ")",
        ]
        lines += [f"[{self.label}] server error: {frames}" for frames in server_errors(self.log)]
        return lines


def report(outcome: Outcome) -> None:
    """Into pytest's terminal summary (``live tests: results``), passed or failed."""
    summary_lines.extend(outcome.summary())


def fail(outcome: Outcome, problems: list[str]) -> None:
    if not problems:
        return
    # The server's log directory is gone by now: keep what it logged.
    kept = Path(tempfile.mkstemp(prefix=f"idem-outage-{outcome.label}-", suffix=".log")[1])
    kept.write_text(outcome.log)
    shown = "\n".join(problems[:40])
    more = f"\n... and {len(problems) - 40} more" if len(problems) > 40 else ""
    tail = "\n".join(outcome.log.splitlines()[-80:])
    pytest.fail(
        f"{len(problems)} problem(s) in the {outcome.label} outage run:\n{shown}{more}\n\n"
        + "\n".join(outcome.summary())
        + f"\n--- gunicorn log (whole run kept at {kept}), last 80 lines ---\n{tail}",
        pytrace=False,
    )


# -- the deployment -----------------------------------------------------------------------


@dataclass
class Deployment:
    server: LiveServer
    #: The PostgreSQL server holding the records: the one the test stops.
    store: OwnPostgres
    #: ``default``: the view's writes (Charges).
    app_db: LiveDatabase
    #: ``IDEMPOTENCY["DATABASE"]``: the records (the same as ``app_db`` fail-closed).
    records_db: LiveDatabase


@contextlib.contextmanager
def deployment(*, fail_open: bool) -> Iterator[Deployment]:
    """Own PostgreSQL server(s), migrated, and gunicorn on them; all gone afterwards."""
    bindir = require_own_postgres()
    with contextlib.ExitStack() as stack:
        app_pg = stack.enter_context(OwnPostgres(bindir, label="app"))
        store = stack.enter_context(OwnPostgres(bindir, label="records")) if fail_open else app_pg
        # Not entered as context managers: the whole cluster is thrown away,
        # and a DROP DATABASE on a stopped server would only mask the failure.
        app_db = LiveDatabase(app_pg.url(), prefix="idem_outage")
        app_pg.create_database(app_db.name)
        records_db = app_db
        if fail_open:
            records_db = LiveDatabase(store.url(), prefix="idem_outage_records")
            store.create_database(records_db.name)
        stack.callback(app_db.close_connection)
        stack.callback(records_db.close_connection)
        env = {
            "IDEMPOTENCY_LEASE": str(LEASE),
            "IDEMPOTENCY_FAIL_OPEN": "1" if fail_open else "0",
            "IDEMPOTENCY_RECORDS_DATABASE_URL": records_db.url if fail_open else "",
        }
        server = LiveServer(app_db, workers=WORKERS, extra_env=env, project=OUTAGE_PROJECT)
        ok = False
        try:
            server.migrate()
            if fail_open:
                # Only the records' table: nothing else is written there.
                server.manage("migrate", "django_idempotency", "--noinput", "--database", "records")
            server.start()
            yield Deployment(server, store, app_db, records_db)
            ok = True
        except BaseException:
            print("\n" + app_pg.log_tail(), file=sys.stderr)
            if store is not app_pg:
                print(store.log_tail(), file=sys.stderr)
            raise
        finally:
            server.stop()
            if ok:
                server.cleanup_logs()
            else:
                print(f"\nlive server log kept at {server.log_path}", file=sys.stderr)


def unresolved(records_db: LiveDatabase) -> list[tuple[Any, ...]]:
    return records_db.query(
        'SELECT id, "key", state, lease_expires_at FROM django_idempotency_record '
        "WHERE state = ANY(%s) ORDER BY id",
        [list(UNRESOLVED)],
    )


def wait_for_leases(records_db: LiveDatabase) -> None:
    """Until every unresolved record's lease has run out, so recovery may take it."""
    row = records_db.query(
        "SELECT COALESCE(EXTRACT(EPOCH FROM MAX(lease_expires_at) - now()), 0) "
        "FROM django_idempotency_record WHERE state = ANY(%s)",
        [list(UNRESOLVED)],
    )[0]
    remaining = float(row[0])
    if remaining > 0:
        time.sleep(min(remaining, LEASE) + 0.2)


def exercise(label: str, *, fail_open: bool, mode: str, seed: int) -> Outcome:
    began = time.monotonic()
    steps: dict[str, float] = {}

    def lap(name: str, since: list[float] = [began]) -> None:  # noqa: B006
        now = time.monotonic()
        steps[name] = now - since[0]
        since[0] = now

    with deployment(fail_open=fail_open) as deployed:
        lap("setup")
        server = deployed.server
        offset = server.log_offset()
        results, keys, timeline = run_outage(
            server, deployed.store, label=label, mode=mode, seed=seed
        )
        lap("load")
        wait_for_leases(deployed.records_db)
        lap("lease wait")
        stuck_before = unresolved(deployed.records_db)
        recovery_output = server.manage("idempotency_recover")
        lap("recovery")
        stuck_after = unresolved(deployed.records_db)
        answered = {s.key for s in results if s.status == 201}
        final = deliver_all(server, [key for key in keys if key not in answered])
        lap("final deliveries")
        records: dict[str, list[tuple[Any, ...]]] = defaultdict(list)
        for row in deployed.records_db.query(
            'SELECT "key", state, response_status, response_body, fencing_token '
            "FROM django_idempotency_record ORDER BY id"
        ):
            records[row[0]].append(row)
        charges: Counter[str] = Counter(
            {
                str(note): int(count)
                for note, count in deployed.app_db.query(
                    "SELECT note, count(*) FROM testapp_charge GROUP BY note"
                )
            }
        )
        outcome = Outcome(
            label=label,
            results=results,
            final=final,
            keys=keys,
            timeline=timeline,
            log=server.log_since(offset),
            recovery_output=recovery_output,
            stuck_before_recovery=stuck_before,
            stuck_after_recovery=stuck_after,
            records=dict(records),
            charges=charges,
            elapsed=time.monotonic() - began,
            steps=steps,
        )
    outcome.steps["teardown"] = time.monotonic() - began - outcome.elapsed
    report(outcome)
    return outcome


# -- assertions shared by both variants ---------------------------------------------------


def answer_lost(outcome: Outcome, key: str) -> bool:
    """Whether ``key`` got a 500 while the server died: its COMMIT may have succeeded.

    A server killed after making a COMMIT durable but before acknowledging
    it leaves the client without the 201 of an execution that happened; the
    retry then gets the replay. The key still has exactly one execution.
    """
    return any(
        s.key == key and s.status in (500, 503) and s.phase == "stopping" for s in outcome.results
    )


def common_problems(
    outcome: Outcome, unrecorded_ok: Callable[[str], bool] = lambda key: False
) -> list[str]:
    """What both variants must satisfy; ``unrecorded_ok(key)``: a key may lack a record."""
    problems: list[str] = []
    not_released = keys_logged(NOT_RELEASED, outcome.log)
    for sent in [*outcome.results, *outcome.final]:
        if sent.error is not None:
            problems.append(f"client exception: {sent.describe()}")
            continue
        if traceback_in_body(sent):
            problems.append(f"a traceback (or driver error) in the body: {sent.describe()}")
        if sent.status == 500:
            # Only a request in flight when the server died may fail, and
            # only in the view (or its commit), after its claim committed:
            # the layer then logs that it could not release that claim.
            if sent.phase != "stopping" or not not_released[sent.key]:
                problems.append(f"500 not explained by the stop: {sent.describe()}")
        elif sent.status == 409:
            payload = json.loads(sent.body)
            if payload.get("code") != IN_PROGRESS or not sent.headers.get("Retry-After"):
                problems.append(f"409 without its code or Retry-After: {sent.describe()}")
            if sent.phase == "outage":
                problems.append(f"409 while the store was down: {sent.describe()}")
        elif sent.status not in (201, 503):
            problems.append(f"unexpected status: {sent.describe()}")
        if sent.final and sent.status != 201:
            problems.append(f"the last delivery of a key did not get its 201: {sent.describe()}")
    if outcome.stuck_after_recovery:
        problems.append(f"records stuck after the recovery run: {outcome.stuck_after_recovery}")
    if "Traceback" in outcome.log and not outcome.log.count("Internal Server Error"):
        problems.append("a traceback in the server log, but no 500 answered")
    if outcome.log.count("Internal Server Error") != sum(
        1 for s in outcome.results if s.status == 500
    ):
        problems.append("server errors logged and 500s answered differ in number")

    responses = outcome.responses()
    for key in outcome.keys:
        rows = outcome.records.get(key, [])
        if not rows and unrecorded_ok(key):
            continue
        if len(rows) != 1 or rows[0][1] != "COMPLETED" or rows[0][2] != 201:
            problems.append(f"{key}: not one COMPLETED 201 record: {[r[:3] for r in rows]}")
            continue
        stored = bytes(rows[0][3])
        created = [s for s in responses[key] if s.status == 201]
        replays = [s for s in created if s.replayed]
        for sent in replays:
            if sent.body != stored:
                problems.append(f"{key}: a replay differs from the stored body: {sent.describe()}")
        protected = [s for s in created if s.body == stored]
        if len({(s.headers.get("Location"), s.headers.get("Content-Type")) for s in protected}) > 1:
            problems.append(f"{key}: Location/Content-Type differ between original and replays")
        if not any(not s.replayed for s in protected) and not answer_lost(outcome, key):
            problems.append(f"{key}: the protected execution's own 201 was never received")
    return problems


# -- the tests ----------------------------------------------------------------------------


def test_store_outage_fail_closed_answers_503_then_recovers_without_stuck_records() -> None:
    outcome = exercise("fail-closed", fail_open=False, mode="immediate", seed=1)
    problems = common_problems(outcome)
    refused = keys_logged(REFUSED, outcome.log)
    answered_503: Counter[str] = Counter()
    for sent in [*outcome.results, *outcome.final]:
        if sent.status == 503:
            answered_503[sent.key] += 1
            problems.extend(check_unavailable_answer(sent))
            if sent.phase not in ("stopping", "outage", "restarting"):
                problems.append(f"503 while the store was up: {sent.describe()}")
        if sent.phase == "outage" and sent.status != 503:
            problems.append(f"not a 503 while the store was down: {sent.describe()}")
    if refused != answered_503:
        problems.append(
            "one 'refusing ... with 503' (or 'store lost') log line per 503 expected: "
            f"{sum(refused.values())} logged, {sum(answered_503.values())} answered"
        )
    outage = [s for s in outcome.results if s.phase == "outage"]
    if len(outage) < 20:
        problems.append(f"only {len(outage)} requests during the outage: the load is too thin")
    responses = outcome.responses()
    for key in outcome.keys:
        firsts = sum(1 for s in responses[key] if s.first_201)
        if firsts == 0 and answer_lost(outcome, key):
            firsts = 1  # the execution's 201 was lost with the server (see answer_lost)
        if outcome.charges[key] != 1 or firsts != 1:
            problems.append(
                f"{key}: {outcome.charges[key]} executions, {firsts} non-replayed 201s "
                f"(exactly one of each expected): "
                + "; ".join(s.describe()[:160] for s in responses[key])
            )
    fail(outcome, problems)


def test_store_outage_fail_open_runs_the_view_and_logs_each_request() -> None:
    outcome = exercise("FAIL_OPEN", fail_open=True, mode="fast", seed=2)
    store_down = {"stopping", "outage", "restarting"}
    responses = outcome.responses()

    def only_while_down(key: str) -> bool:
        """Sent only while the store was down: run unprotected only, so no record."""
        return all(s.phase in store_down for s in responses[key])

    problems = common_problems(outcome, unrecorded_ok=only_while_down)
    warned = keys_logged(FAIL_OPEN_RUN, outcome.log)
    if keys_logged(REFUSED_AT_CLAIM, outcome.log):
        problems.append("a claim was refused with 503 although FAIL_OPEN is on")
    for sent in [*outcome.results, *outcome.final]:
        # A request already past its claim when the store died cannot run
        # unprotected any more: its writes rolled back with the lost
        # completion, and it is told 503 (retry later), truthfully.
        if sent.status == 503 and sent.phase != "stopping":
            problems.append(f"503 although FAIL_OPEN is on: {sent.describe()}")
        if sent.phase == "outage" and not (sent.first_201 and warned[sent.key]):
            problems.append(f"the view did not run (and warn) during the outage: {sent.describe()}")
    outage = [s for s in outcome.results if s.phase == "outage"]
    if len(outage) < 20:
        problems.append(f"only {len(outage)} requests during the outage: the load is too thin")
    for key in outcome.keys:
        firsts = sum(1 for s in responses[key] if s.first_201)
        executions = outcome.charges[key]
        protected = len(outcome.records.get(key, []))
        # Every non-replayed 201 is one execution: the protected one, if the
        # key has its (COMPLETED) record, plus one unprotected run per warning.
        if not (executions == firsts == warned[key] + protected):
            problems.append(
                f"{key}: {executions} executions, {firsts} non-replayed 201s, {warned[key]} "
                f"FAIL_OPEN warnings, {protected} record(s) (expected executions == 201s == "
                "warnings + records): " + "; ".join(s.describe()[:160] for s in responses[key])
            )
        if not any(s.phase in store_down for s in responses[key]) and executions != 1:
            problems.append(f"{key}: never sent while the store was down, yet {executions} runs")
    fail(outcome, problems)
