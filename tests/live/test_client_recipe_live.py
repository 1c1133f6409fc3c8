"""The client recipe of docs/clients.md through a broken network: one effect per operation.

A real deployment: a fresh PostgreSQL database, gunicorn with 2 sync
workers serving the test project (``tests.live.outage_settings``: a 2 s
lease), and in front of it ``FaultProxy`` (tests/live/fault_proxy.py),
through which every request goes. Each operation is one call of the
recipe (httpx sync, httpx async, requests), which keys it once and sends
``POST /api-view/charges`` with the key as the Charge's ``note``. Each meets
one hazard on its first request:

- none: answered at once, not a replay;
- the answer dropped: the server ran it, its client's connection was reset
  before the answer arrived; the retry is answered from the record;
- the connection cut once the server had claimed the key, while the view
  runs (it sleeps): the retry meets it (409, ``Retry-After: 1``) or its
  outcome, and is answered from the record;
- the worker killed (SIGKILL) in the middle of the view, its transaction
  lost with it: the retries get 409 until the lease of the dead owner's
  claim runs out, then take it over and run the view: not a replay;
- the store refusing connections (``ALLOW_CONNECTIONS false`` on the
  database): 503 ``idempotency_store_unavailable`` with ``Retry-After: 5``;
  connections are allowed again as soon as each such operation has had its
  503, and the retry after ``Retry-After`` runs it: not a replay. The other
  operations start once the store is back.

Then, for every operation: the recipe's answer is the 201 of its one
execution (a replay exactly where the hazard says), there is exactly one
Charge and one COMPLETED record under its key, every request the proxy saw
for it carried that key, the recipe counted them all, and no request
followed an answer with ``Retry-After`` sooner than it said. A summary per
variant goes to the terminal summary ("live tests: results").
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import psycopg
import pytest
import requests
from psycopg import sql

from docs.examples import idempotent_client, idempotent_client_requests
from tests.live.fault_proxy import Exchange, Fault, FaultProxy
from tests.live.processes import summary_lines
from tests.live.server import DEFAULT_APP, Lazy, LiveDatabase, LiveServer, Project, live_server
from tests.live.services import require_postgres

pytestmark = [pytest.mark.postgres, pytest.mark.live]

PROJECT = Project(
    settings="tests.live.outage_settings",
    app=DEFAULT_APP,
    ready_path="/api-view/charges",
    ready_statuses=(200,),
)
CHARGES = "/api-view/charges"
LEASE = 2.0
#: Seconds the view sleeps after the claim, for the faults that strike then.
VIEW_SLEEP = {Fault.CUT_AFTER_CLAIM: 0.8, Fault.WORKER_KILLED: 1.5}
#: Each attempt's own bound: longer than any wait behind the other requests,
#: so that no answer is lost to the client's impatience.
ATTEMPT_TIMEOUT = 30.0
DEADLINE = 45.0
STORE_DOWN = "store down"
NONE = "none"
#: Whether the answer the recipe returns is a replay, per hazard.
REPLAYED = {
    NONE: False,
    Fault.ANSWER_DROPPED.value: True,
    Fault.CUT_AFTER_CLAIM.value: True,
    Fault.WORKER_KILLED.value: False,
    STORE_DOWN: False,
}


@dataclass(frozen=True)
class Stack:
    server: LiveServer
    proxy: FaultProxy

    @property
    def database(self) -> LiveDatabase:
        return self.server.database


def claimer(database: LiveDatabase) -> Callable[[str], int | None]:
    """The pid in the CLAIMED record of a key (``lease_owner`` is host:pid:thread)."""

    def pid(key: str) -> int | None:
        rows = database.query(
            'SELECT lease_owner FROM django_idempotency_record WHERE "key" = %s '
            "AND state = 'CLAIMED'",
            [key],
        )
        return int(rows[0][0].rsplit(":", 2)[1]) if rows else None

    return pid


@contextlib.contextmanager
def recipe_stack() -> Iterator[Stack]:
    with live_server(
        require_postgres(),
        workers=2,
        project=PROJECT,
        extra_env={"IDEMPOTENCY_LEASE": str(LEASE)},
        # One request per process: a killed worker takes only its own request.
        extra_args=("--worker-class", "sync", "--threads", "1"),
    ) as server:
        assert server.process is not None
        with FaultProxy(server.port, claimer(server.database), server.process.pid) as proxy:
            yield Stack(server, proxy)


@pytest.fixture(scope="module")
def stack() -> Iterator[Lazy[Stack]]:
    lazy = Lazy(recipe_stack, require_postgres)
    try:
        yield lazy
    finally:
        lazy.close()


# -- the operations ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Operation:
    key: str
    hazard: str

    @property
    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"amount": 100, "note": self.key}
        fault = {fault.value: fault for fault in Fault}.get(self.hazard)
        if fault in VIEW_SLEEP:
            body["sleep"] = VIEW_SLEEP[fault]
        return body


def plan(variant: str, counts: dict[str, int]) -> list[Operation]:
    run = uuid.uuid4().hex[:8]
    return [
        Operation(f"{variant}-{run}-{hazard.replace(' ', '-')}-{number}", hazard)
        for hazard, count in counts.items()
        for number in range(count)
    ]


@dataclass
class Answer:
    """What the recipe returned for one operation."""

    status: int | None = None
    replayed: bool = False
    body: bytes = b""
    attempts: int = 0
    error: str | None = None


# -- the store refusing connections ------------------------------------------------------------


def allow_connections(database: LiveDatabase, allowed: bool) -> None:
    statement = sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS {}").format(
        sql.Identifier(database.name), sql.Literal(allowed)
    )
    with psycopg.connect(database.server_url, autocommit=True, connect_timeout=5) as admin:
        admin.execute(statement)


@contextlib.contextmanager
def store_down_until_refused(stack: Stack, keys: list[str]) -> Iterator[threading.Event]:
    """Refuse connections to the database until each key's request got its 503.

    Yields the event set once connections are allowed again; they are
    allowed again at the latest when the block ends.
    """
    back = threading.Event()
    stack.database.query("SELECT 1")  # the test's own connection, open before

    def wait_then_allow() -> None:
        deadline = time.monotonic() + 20
        try:
            while time.monotonic() < deadline and not all(
                any(e.status == 503 and e.delivered for e in stack.proxy.history(key))
                for key in keys
            ):
                time.sleep(0.02)
        finally:
            allow_connections(stack.database, True)
            back.set()

    allow_connections(stack.database, False)
    watcher = threading.Thread(target=wait_then_allow, name="store-back", daemon=True)
    watcher.start()
    try:
        yield back
    finally:
        watcher.join(30)
        allow_connections(stack.database, True)


# -- the three variants of the recipe ----------------------------------------------------------


def run_with_httpx(
    stack: Stack, operations: list[Operation], back: threading.Event
) -> list[Answer]:
    def one(operation: Operation) -> Answer:
        if operation.hazard != STORE_DOWN:
            back.wait(30)
        with httpx.Client(base_url=stack.proxy.url, timeout=ATTEMPT_TIMEOUT) as client:
            outcome = idempotent_client.send_idempotent(
                client, "POST", CHARGES, json=operation.body, key=operation.key, deadline=DEADLINE
            )
        response = outcome.response
        return Answer(response.status_code, outcome.replayed, response.content, outcome.attempts)

    return run_in_threads(one, operations)


def run_with_requests(
    stack: Stack, operations: list[Operation], back: threading.Event
) -> list[Answer]:
    def one(operation: Operation) -> Answer:
        if operation.hazard != STORE_DOWN:
            back.wait(30)
        with requests.Session() as session:
            outcome = idempotent_client_requests.send_idempotent(
                session,
                "POST",
                stack.proxy.url + CHARGES,
                json=operation.body,
                key=operation.key,
                deadline=DEADLINE,
                timeout=ATTEMPT_TIMEOUT,
            )
        response = outcome.response
        return Answer(response.status_code, outcome.replayed, response.content, outcome.attempts)

    return run_in_threads(one, operations)


def run_in_threads(one: Callable[[Operation], Answer], operations: list[Operation]) -> list[Answer]:
    def guarded(operation: Operation) -> Answer:
        try:
            return one(operation)
        except Exception as exc:  # reported with the operation, never lost in a thread
            return Answer(error=f"{type(exc).__name__}: {exc}")

    with ThreadPoolExecutor(len(operations)) as pool:
        return list(pool.map(guarded, operations))


def run_with_httpx_async(
    stack: Stack, operations: list[Operation], back: threading.Event
) -> list[Answer]:
    async def one(client: httpx.AsyncClient, operation: Operation) -> Answer:
        if operation.hazard != STORE_DOWN:
            await asyncio.to_thread(back.wait, 30)
        try:
            outcome = await idempotent_client.send_idempotent_async(
                client, "POST", CHARGES, json=operation.body, key=operation.key, deadline=DEADLINE
            )
        except Exception as exc:
            return Answer(error=f"{type(exc).__name__}: {exc}")
        response = outcome.response
        return Answer(response.status_code, outcome.replayed, response.content, outcome.attempts)

    async def all_of_them() -> list[Answer]:
        limits = httpx.Limits(max_connections=len(operations))
        async with httpx.AsyncClient(
            base_url=stack.proxy.url, timeout=ATTEMPT_TIMEOUT, limits=limits
        ) as client:
            return list(await asyncio.gather(*(one(client, op) for op in operations)))

    return asyncio.run(all_of_them())


Runner = Callable[[Stack, list[Operation], threading.Event], list[Answer]]

VARIANTS: dict[str, tuple[Runner, dict[str, int]]] = {
    "httpx": (
        run_with_httpx,
        {
            STORE_DOWN: 3,
            NONE: 12,
            Fault.ANSWER_DROPPED.value: 6,
            Fault.CUT_AFTER_CLAIM.value: 4,
            Fault.WORKER_KILLED.value: 3,
        },
    ),
    "httpx-async": (
        run_with_httpx_async,
        {
            STORE_DOWN: 2,
            NONE: 4,
            Fault.ANSWER_DROPPED.value: 3,
            Fault.CUT_AFTER_CLAIM.value: 2,
            Fault.WORKER_KILLED.value: 1,
        },
    ),
    "requests": (
        run_with_requests,
        {
            STORE_DOWN: 1,
            NONE: 3,
            Fault.ANSWER_DROPPED.value: 2,
            Fault.CUT_AFTER_CLAIM.value: 1,
            Fault.WORKER_KILLED.value: 1,
        },
    ),
}


# -- the test ------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_operation_takes_effect_once_through_dropped_connections_killed_workers_and_an_outage(
    stack: Lazy[Stack], variant: str
) -> None:
    live = stack.get()
    runner, counts = VARIANTS[variant]
    operations = plan(variant, counts)
    live.proxy.break_first_request(
        {op.key: fault for op in operations for fault in Fault if op.hazard == fault.value}
    )
    log_offset = live.server.log_offset()
    started = time.monotonic()

    down = [op.key for op in operations if op.hazard == STORE_DOWN]
    with store_down_until_refused(live, down) as back:
        answers = runner(live, operations, back)
    elapsed = time.monotonic() - started

    report = Report(live, operations, answers)
    summary_lines.append(f"client recipe, {variant}: {report.summary(elapsed)}")
    report.check()
    # The outage and the killed workers are logged; no request failed otherwise.
    log = live.server.log_since(log_offset)
    assert "Traceback" not in log and "Internal Server Error" not in log, log


class Report:
    """Each operation's answer beside what the proxy and the database saw of it."""

    def __init__(self, stack: Stack, operations: list[Operation], answers: list[Answer]) -> None:
        self.stack = stack
        self.operations = operations
        self.answers = dict(zip((op.key for op in operations), answers, strict=True))
        self.histories = {op.key: stack.proxy.history(op.key) for op in operations}

    def check(self) -> None:
        failures = [
            f"{op.key} ({op.hazard}): {problem}\n  answer: {self.answers[op.key]}\n  "
            + "\n  ".join(exchange.describe() for exchange in self.histories[op.key])
            for op in self.operations
            if (problem := self.problem(op))
        ]
        assert not failures, "\n".join(failures) + "\n" + self.stack.server.diagnostics()

    def problem(self, op: Operation) -> str | None:
        answer, history = self.answers[op.key], self.histories[op.key]
        charges = self.stack.database.charge_ids(op.key)
        records = self.stack.database.records(op.key)
        executions = [e for e in history if e.status == 201 and not e.replayed]
        if len(charges) != 1:
            return f"{len(charges)} charges"
        if [(r["state"], r["response_status"]) for r in records] != [("COMPLETED", 201)]:
            return f"records {records}"
        if answer.error is not None:
            return f"the recipe raised {answer.error}"
        if (answer.status, answer.replayed) != (201, REPLAYED[op.hazard]):
            return f"answered {answer.status}, replayed={answer.replayed}"
        if json.loads(answer.body)["id"] != charges[0] or len(executions) != 1:
            return "the answer is not the one execution's"
        if answer.replayed and answer.body != executions[0].body:
            return "the replay differs from the answer of the execution"
        if answer.attempts != len(history):
            return f"the recipe counted {answer.attempts} attempts, the proxy saw {len(history)}"
        if not all(json.loads(e.request_body)["note"] == op.key for e in history):
            return "a request of another operation was sent under this key"
        if early := [e for e, later in itertools.pairwise(history) if too_early(e, later)]:
            return f"retried before Retry-After: {[e.describe() for e in early]}"
        return self.first_request_problem(op, history[0])

    def first_request_problem(self, op: Operation, first: Exchange) -> str | None:
        if op.hazard == STORE_DOWN:
            code = json.loads(first.body or b"{}").get("code")
            if (first.status, code) != (503, "idempotency_store_unavailable"):
                return f"its first request was answered {first.status} {code}"
        if op.hazard == Fault.WORKER_KILLED.value and first.status is not None:
            return "its worker answered, it was not killed"
        if op.hazard != NONE and len(self.histories[op.key]) < 2:
            return "it was not retried"
        return None

    def summary(self, elapsed: float) -> str:
        statuses: Counter[str] = Counter()
        for history in self.histories.values():
            statuses.update(str(e.status) + (" replay" if e.replayed else "") for e in history)
        attempts = sum(len(history) for history in self.histories.values())
        return (
            f"{len(self.operations)} operations, {attempts} requests in {elapsed:.1f}s, "
            f"{len(self.stack.proxy.killed)} workers killed so far; answers seen: "
            + ", ".join(f"{status} x{n}" for status, n in sorted(statuses.items()))
        )


def too_early(answer: Exchange, retry: Exchange) -> bool:
    """Whether ``retry`` followed a delivered answer sooner than its ``Retry-After``."""
    wait = answer.retry_after if answer.delivered else None
    return wait is not None and retry.arrived - answer.answered < wait
