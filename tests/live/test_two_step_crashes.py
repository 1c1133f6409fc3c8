"""Crash tests of a two-step payment: authorize, then capture, workers SIGKILLed between and inside.

The same real processes as ``test_crashes.py`` (``tests.live.processes.payments_stack``):
PostgreSQL, gunicorn serving the demo project (a 2 s lease), the provider
simulator with its own ledger, and a Celery worker on Redis running
``recover_stale_records``. The view is ``POST /v1/payments/two-step``
(``payments/two_step.py``); its reconciler is
``payments.reconcilers.settle_two_step_payment``, which reads the record's
steps.

A trial, per kill point (``payments.crash_hooks.STEP_POINTS``):

1. POST with a new key and ``X-Crash-At: <point>``: the worker SIGKILLs
   itself there, the connection drops; the record's state is read;
2. retry at once without the header: 409, the record is held;
3. once the lease ran out, ``recover_stale_records`` in the Celery worker;
4. retry without the header until the answer is not a 409.

Then, per key: one authorization and one capture in the provider's ledger,
each requested once (the ledger counts every request under an idempotency
id: a step sent again would show two attempts), one Payment paid by the
capture, one COMPLETED record holding the 201 the client got, whose steps
carry both provider ids. The table of the results goes to the end-of-run
summary (``-s`` not needed).

``STEP_CRASH_TRIALS`` (default 3) sets the trials per point; they run in
parallel, so the module takes about a lease and a recovery per point,
plus the stack's start.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pytest
from payments.crash_hooks import STEP_POINTS
from payments.demo_data import DEMO_TOKENS

from tests.live.crash_trials import recover_then_retry
from tests.live.processes import PaymentsStack, summary_lines
from tests.live.server import Lazy, Result, post

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.live,
    pytest.mark.guarantees,
    pytest.mark.not_under(
        "repeatable-read",
        reason="begin_external() is refused above READ COMMITTED on PostgreSQL "
        "(IsolationNotSupported; tests/test_isolation.py)",
        databases=("postgres",),
    ),
]

TRIALS = int(os.environ.get("STEP_CRASH_TRIALS", "3"))
URL = "/v1/payments/two-step"

#: What recovery must do after a kill at each point, and whether the client's
#: final 201 is the stored one (replayed) or the re-run view's.
EXPECTED = {
    # Nothing at the provider: released; the retry runs the whole payment.
    "after-authorize-begin": ("released", False),
    # Authorized (its id unrecorded: the reconciler finds it), never
    # captured: handed back from the capture; the retry skips the authorization.
    "after-authorize": ("handed_back", False),
    "after-authorize-recorded": ("handed_back", False),
    "after-capture-begin": ("handed_back", False),
    # Captured: the reconciler completes the payment; the retry gets the replay.
    "after-capture": ("completed", True),
    "after-capture-recorded": ("completed", True),
}
ROWS: list[dict[str, Any]] = []


def auth() -> dict[str, str]:
    return {"Authorization": f"Token {DEMO_TOKENS['alice']}"}


def lease_expired(stack: PaymentsStack, key: str) -> bool:
    """Whether the dead owner's lease ran out (or another trial's recovery settled the record:
    a record handed back has no owner, and a lease until its retention ends)."""
    rows = stack.database.query(
        "SELECT lease_expires_at IS NULL OR lease_expires_at <= now() OR lease_owner = '' "
        'FROM django_idempotency_record WHERE "key" = %s',
        [key],
    )
    return not rows or bool(rows[0][0])


def record_state(stack: PaymentsStack, key: str) -> str:
    records = stack.database.records(key)
    return records[0]["state"] if records else "(none)"


def steps_of(stack: PaymentsStack, key: str) -> list[tuple[str, str, str]]:
    rows = stack.database.query(
        "SELECT s.name, s.provider_key, s.provider_operation_id FROM django_idempotency_step s "
        'JOIN django_idempotency_record r ON r.id = s.record_id WHERE r."key" = %s '
        "ORDER BY s.begun_at, s.id",
        [key],
    )
    return [(str(name), str(pkey), str(pid)) for name, pkey, pid in rows]


@dataclass
class Trial:
    point: str
    number: int
    key: str
    order_id: str
    body: dict[str, Any]
    state_after_crash: str = ""
    steps_after_crash: str = ""
    crash: Result | None = None
    early_retry: Result | None = None
    recoveries: list[dict[str, int]] = field(default_factory=list)
    retries: list[Result] = field(default_factory=list)
    final: Result | None = None
    error: str | None = None

    def describe(self) -> str:
        lines = [f"trial {self.point}#{self.number} key={self.key!r} order={self.order_id!r}"]
        if self.error:
            lines.append(f"  error: {self.error}")
        lines.append(f"  after the crash: {self.state_after_crash}; {self.steps_after_crash}")
        for name, result in (("crash", self.crash), ("early retry", self.early_retry)):
            if result is not None:
                lines.append(f"  {name}: {result.describe(200)}")
        lines.append(f"  recoveries: {self.recoveries}")
        if self.final is not None:
            lines.append(f"  final: {self.final.describe(200)}")
        return "\n".join(lines)


def run_trial(stack: PaymentsStack, point: str, number: int) -> Trial:
    tag = uuid.uuid4().hex[:8]
    trial = Trial(
        point=point,
        number=number,
        key=f"two-step-{point}-{number}-{tag}",
        order_id=f"TWO-{point}-{number}-{tag}",
        body={"amount": 700 + number, "currency": "EUR"},
    )
    trial.body["order_id"] = trial.order_id
    url = stack.url + URL
    headers = {**auth(), "Idempotency-Key": trial.key}
    try:
        trial.crash = post(url, trial.body, {**headers, "X-Crash-At": point})
        crashed_at = time.monotonic()
        trial.state_after_crash = record_state(stack, trial.key)
        trial.steps_after_crash = ", ".join(
            f"{name} ({'id' if pid else 'no id'})" for name, _, pid in steps_of(stack, trial.key)
        )
        trial.early_retry = post(url, trial.body, headers)
        recover_then_retry(
            stack,
            trial,
            url,
            headers,
            crashed_at=crashed_at,
            lease_over=lambda: lease_expired(stack, trial.key),
        )
    except Exception as exc:  # reported with the trial, never lost in a thread
        trial.error = f"{type(exc).__name__}: {exc}"
    return trial


def trial_issues(
    stack: PaymentsStack, trial: Trial, entries: list[dict[str, Any]]
) -> tuple[list[str], Counter[str]]:
    """What is wrong with one trial (nothing, normally), and its counts for the table."""
    counts = Counter[str]()
    if trial.error:
        return ["the trial raised"], counts
    assert trial.crash is not None and trial.early_retry is not None
    issues = []
    if trial.crash.error is None:
        issues.append("the crash request got an answer: the worker did not die")
    if trial.early_retry.status != 409:
        issues.append(f"the retry at once got {trial.early_retry.status}, not 409")
    by_step: dict[str, list[dict[str, Any]]] = {}
    for entry in entries:
        by_step.setdefault(str(entry["metadata"].get("step")), []).append(entry)
    for name in ("authorize", "capture"):
        calls = sum(int(entry["attempts"]) for entry in by_step.get(name, []))
        counts[f"{name} calls"] += calls
        if len(by_step.get(name, [])) != 1 or calls != 1:
            issues.append(f"{name}: {len(by_step.get(name, []))} entries, {calls} requests")
    payments = stack.database.query(
        "SELECT id, provider_charge_id FROM payments_payment WHERE order_id = %s", [trial.order_id]
    )
    records = stack.database.records(trial.key)
    if len(payments) != 1:
        issues.append(f"{len(payments)} payments, not one")
    if len(records) != 1 or records[0]["state"] != "COMPLETED":
        issues.append("not exactly one record, COMPLETED")
    if trial.final is None or trial.final.status != 201:
        issues.append(f"the final answer is {trial.final and trial.final.status}, not 201")
        return issues, counts
    counts["final 201"] += 1
    counts["final replayed"] += int(trial.final.replayed)
    answer = json.loads(trial.final.body)
    if len(payments) == 1:
        if answer.get("id") != payments[0][0]:
            issues.append("the final 201 does not describe the payment")
        captures = by_step.get("capture", [])
        if captures and payments[0][1] != captures[0]["id"]:
            issues.append("the payment is not paid by the capture")
    if records and bytes(records[0]["response_body"] or b"") != trial.final.body:
        issues.append("the final answer is not the stored response")
    # Every provider id recorded on a step is the provider's (one the view
    # died before recording stays empty, unless a reconciler found it).
    ids = {name: pid for name, _, pid in steps_of(stack, trial.key)}
    expected_ids = {name: found[0]["id"] for name, found in by_step.items() if len(found) == 1}
    if set(ids) != {"authorize", "capture"} or any(
        pid and pid != expected_ids.get(name) for name, pid in ids.items()
    ):
        issues.append(f"the steps' provider ids {ids} are not the provider's {expected_ids}")
    if trial.final.replayed:
        # Completed by recovery: the capture's id is on the record (searchable in the admin).
        rows = stack.database.query(
            'SELECT provider_operation_id FROM django_idempotency_record WHERE "key" = %s',
            [trial.key],
        )
        if not rows or rows[0][0] != expected_ids.get("capture"):
            issues.append(f"the record's provider_operation_id is {rows}, not the capture's")
    return issues, counts


@pytest.fixture(scope="module", autouse=True)
def print_table() -> Iterator[None]:
    started = time.monotonic()
    yield
    if not ROWS:
        return
    columns = [
        ("point", 26),
        ("trials", 6),
        ("state after crash", 17),
        ("steps after crash", 36),
        ("recovery", 30),
        ("authorize calls", 15),
        ("capture calls", 13),
        ("client's answer", 28),
    ]
    header = " | ".join(name.ljust(width) for name, width in columns)
    lines = [header, "-" * len(header)]
    for row in ROWS:
        lines.append(" | ".join(str(row[name]).ljust(width) for name, width in columns))
    summary_lines.extend(
        [
            f"two-step crash tests: {TRIALS} trials per point, SIGKILL at each point, recovery "
            f"by a Celery worker ({time.monotonic() - started:.1f} s for the module)",
            "calls: requests at the provider per step, over the trials (one each means once)",
            *lines,
        ]
    )


@pytest.mark.parametrize("point", STEP_POINTS)
def test_sigkill_at_point_then_recovery_and_retry(
    payments: Lazy[PaymentsStack], point: str
) -> None:
    """Each step's provider call happens once, and the client gets one answer: the 201."""
    stack = payments.get()
    with ThreadPoolExecutor(max_workers=TRIALS, thread_name_prefix=f"two-{point}") as pool:
        trials = list(pool.map(lambda n: run_trial(stack, point, n), range(TRIALS)))
    by_order = stack.provider.charges_by_order()
    problems: list[str] = []
    row = Counter[str]()
    states = Counter[str]()
    steps_seen = Counter[str]()
    for trial in trials:
        issues, counts = trial_issues(stack, trial, by_order.get(trial.order_id, []))
        row.update(counts)
        states[trial.state_after_crash] += 1
        steps_seen[trial.steps_after_crash] += 1
        for report in trial.recoveries:
            for outcome in ("released", "handed_back", "completed", "failed", "retried"):
                row[outcome] += report.get(outcome, 0)
        if issues:
            problems.append("; ".join(issues) + "\n" + trial.describe())
    assert not problems, (
        f"{len(problems)} trial(s) at {point} went wrong:\n\n"
        + "\n\n".join(problems[:3])
        + "\n\n"
        + stack.diagnostics()
    )
    outcome, replayed = EXPECTED[point]
    assert row[outcome] == TRIALS, (point, dict(row))
    assert sum(row[name] for name in ("released", "handed_back", "completed")) == TRIALS
    assert row["final replayed"] == (TRIALS if replayed else 0)
    assert row["authorize calls"] == row["capture calls"] == TRIALS
    answer = "201 replayed (stored)" if replayed else "201 from the re-run view"
    ROWS.append(
        {
            "point": point,
            "trials": TRIALS,
            "state after crash": ", ".join(sorted(states)),
            "steps after crash": " | ".join(sorted(steps_seen)),
            "recovery": {
                "released": "Release (nothing called)",
                "handed_back": "RetryFrom('capture')",
                "completed": "Completed (capture found)",
            }[outcome]
            + f" x{row[outcome]}",
            "authorize calls": row["authorize calls"],
            "capture calls": row["capture calls"],
            "client's answer": f"{answer} x{row['final 201']}",
        }
    )
