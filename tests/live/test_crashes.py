"""Crash tests: gunicorn workers SIGKILLed mid-payment, settled by a real Celery worker.

Everything is a real process (``tests.live.processes.payments_stack``):
PostgreSQL, gunicorn serving the demo project's payments API (4 workers, a
2 s idempotency lease), the payment provider simulator with its own ledger,
and ``celery -A testproject worker --pool=solo`` on a Redis broker.

A trial, per crash point (``payments/crash_hooks.py``):

1. POST a payment with a new key and ``X-Crash-At: <point>``: the worker
   SIGKILLs itself there, the connection drops;
2. retry at once without the header: a 409 (the record is held), or, after
   the commit, the replay (a retry that queued behind worker restarts past
   the lease may also find the outcome another trial's recovery settled);
3. wait for the lease to run out, then send ``recover_stale_records`` to
   the Celery worker and wait for its result;
4. retry without the header until the answer is not a 409.

Then, for every key: one charge in the provider's ledger, one Payment,
paid by that charge, one COMPLETED record holding the 201 the client
finally got. The trials of one point run in parallel. A table of the
results is printed at the end of the module (point, trials, charges,
payments, duplicates, lost charges).

The fencing tests stall an owner past its lease instead (a slow provider, a
stall after the charge, a stall after the Payment write): recovery takes
the record over meanwhile, and the stale owner, when it wakes up, changes
nothing: its writes roll back, its client gets 409, and there is still one
charge and one payment.

``CRASH_TRIALS`` (default 20) sets the trials per point.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pytest
from payments.crash_hooks import POINTS
from payments.demo_data import DEMO_TOKENS

from tests.live.crash_trials import SETTLE_DEADLINE, recover_then_retry
from tests.live.processes import PaymentsStack, summary_lines
from tests.live.server import Lazy, Result, post

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.live,
    pytest.mark.guarantees,
    # The demo's payment view calls begin_external(), refused at this level.
    pytest.mark.not_under(
        "repeatable-read",
        reason="begin_external() is refused above READ COMMITTED on PostgreSQL "
        "(IsolationNotSupported; tests/test_isolation.py)",
        databases=("postgres",),
    ),
]

TRIALS = int(os.environ.get("CRASH_TRIALS", "20"))
PAYMENTS = "/v1/payments"
OPERATION = "POST v1/payments"
IN_PROGRESS = "idempotency_request_in_progress"
OUTCOME_UNCERTAIN = "idempotency_outcome_uncertain"

ROWS: list[dict[str, Any]] = []
#: Points before any charge: once released, a retry runs the view afresh.
FRESH_RUN_POINTS = ("after-claim", "after-begin-external")


# -- helpers ---------------------------------------------------------------------------------


def auth(user: str = "alice") -> dict[str, str]:
    return {"Authorization": f"Token {DEMO_TOKENS[user]}"}


def alice_id(stack: PaymentsStack) -> int:
    rows = stack.database.query("SELECT id FROM auth_user WHERE username = 'alice'")
    return int(rows[0][0])


def payments_for(stack: PaymentsStack, order_ids: list[str]) -> dict[str, list[dict[str, Any]]]:
    rows = stack.database.query(
        "SELECT order_id, id, provider_charge_id, amount, owner_id FROM payments_payment "
        "WHERE order_id = ANY(%s) ORDER BY id",
        [order_ids],
    )
    grouped: dict[str, list[dict[str, Any]]] = {order_id: [] for order_id in order_ids}
    for order_id, pk, charge_id, amount, owner_id in rows:
        grouped[order_id].append(
            {"id": pk, "provider_charge_id": charge_id, "amount": amount, "owner_id": owner_id}
        )
    return grouped


def lease_expired(stack: PaymentsStack, key: str) -> bool:
    """Whether the key's record is gone or its lease ran out, by the database's clock."""
    rows = stack.database.query(
        "SELECT lease_expires_at IS NULL OR lease_expires_at <= now() FROM "
        'django_idempotency_record WHERE "key" = %s',
        [key],
    )
    return not rows or bool(rows[0][0])


def wait_for_lease_expiry(stack: PaymentsStack, key: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not lease_expired(stack, key):
        assert time.monotonic() < deadline, f"the lease of {key!r} never ran out"
        time.sleep(0.1)


def error_code(result: Result) -> str | None:
    try:
        body = json.loads(result.body)
    except ValueError:
        return None
    return body.get("code") if isinstance(body, dict) else None


# -- one crash trial ---------------------------------------------------------------------------


@dataclass
class Trial:
    point: str
    number: int
    key: str
    order_id: str
    body: dict[str, Any]
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
        for name, result in (("crash", self.crash), ("early retry", self.early_retry)):
            if result is not None:
                lines.append(f"  {name}: {result.describe(200)}")
        lines.append(f"  recoveries: {self.recoveries}")
        lines.append(f"  retries: {len(self.retries)} ({Counter(r.status for r in self.retries)})")
        if self.final is not None:
            lines.append(f"  final: {self.final.describe(200)}")
        return "\n".join(lines)


def run_trial(stack: PaymentsStack, point: str, number: int, run: str) -> Trial:
    tag = uuid.uuid4().hex[:8]
    trial = Trial(
        point=point,
        number=number,
        key=f"crash-{point}-{run}-{number}-{tag}",
        order_id=f"ORD-{point}-{number}-{tag}",
        body={"order_id": "", "amount": 1000 + number, "currency": "EUR"},
    )
    trial.body["order_id"] = trial.order_id
    url = stack.url + PAYMENTS
    headers = {**auth(), "Idempotency-Key": trial.key}
    try:
        trial.crash = post(url, trial.body, {**headers, "X-Crash-At": point})
        crashed_at = time.monotonic()
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
    trial: Trial,
    point: str,
    owner: int,
    charges: list[dict[str, Any]],
    payments: list[dict[str, Any]],
    records: list[dict[str, Any]],
) -> list[str]:
    """What is wrong with one trial's outcome (nothing, normally)."""
    if trial.error:
        return ["the trial raised"]
    assert trial.crash is not None and trial.early_retry is not None
    issues = []
    if trial.crash.error is None:
        issues.append("the crash request got an answer: the worker did not die")
    early = trial.early_retry
    if point == "after-commit":
        if not (early.status == 201 and early.replayed):
            issues.append("right after a crash after the commit, a retry must get the replay")
    elif not (
        (early.status == 409 and error_code(early) == IN_PROGRESS)
        # A retry that queued behind worker restarts until the lease ran out
        # may find the record settled by another trial's recovery run (a
        # replay, or a fresh run after a release), or take an abandoned
        # claim over: never anything but the one outcome.
        or (early.status == 201 and (early.replayed or point in FRESH_RUN_POINTS))
    ):
        issues.append("right after the crash, a retry must get 409 (the record is held)")
    if len(charges) != 1:
        issues.append(f"{len(charges)} provider charges, not one")
    if len(payments) != 1:
        issues.append(f"{len(payments)} payments, not one")
    completed = [record for record in records if record["state"] == "COMPLETED"]
    if len(records) != 1 or len(completed) != 1:
        issues.append("not exactly one record, COMPLETED")
    if trial.final is None:
        return [*issues, "no non-409 answer within the deadline"]
    if trial.final.status != 201:
        return [*issues, f"the final answer is {trial.final.status}, not 201"]
    answer = json.loads(trial.final.body)
    if len(payments) == 1 and len(charges) == 1:
        payment = payments[0]
        if answer.get("id") != payment["id"] or answer.get("order_id") != trial.order_id:
            issues.append("the final 201 does not describe the payment")
        if payment["provider_charge_id"] != charges[0]["id"]:
            issues.append("the payment is not paid by the provider's charge")
        if payment["owner_id"] != owner or payment["amount"] != trial.body["amount"]:
            issues.append("the payment has the wrong owner or amount")
        if charges[0]["amount"] != trial.body["amount"]:
            issues.append("the charge has the wrong amount")
    if trial.final.headers.get("Location") != f"{PAYMENTS}/{answer.get('id')}":
        issues.append("the final 201 lacks the payment's Location")
    if completed and bytes(completed[0]["response_body"]) != trial.final.body:
        issues.append("the final answer is not the stored response")
    return issues


def check_trials(stack: PaymentsStack, point: str, trials: list[Trial]) -> dict[str, Any]:
    """Assert every invariant per key; return the point's table row."""
    charges = stack.provider.charges_by_order()
    payments = payments_for(stack, [trial.order_id for trial in trials])
    owner = alice_id(stack)
    problems: list[str] = []
    row = Counter[str]()

    for trial in trials:
        trial_charges = charges.get(trial.order_id, [])
        trial_payments = payments[trial.order_id]
        records = stack.database.records(trial.key)
        completed = [record for record in records if record["state"] == "COMPLETED"]
        row["charges"] += len(trial_charges)
        row["payments"] += len(trial_payments)
        row["completed"] += len(completed)
        row["duplicates"] += max(0, len(trial_charges) - 1) + max(0, len(trial_payments) - 1)
        paid = {payment["provider_charge_id"] for payment in trial_payments}
        if trial_charges and not ({charge["id"] for charge in trial_charges} & paid and completed):
            row["lost"] += 1
        if trial.crash is not None and trial.crash.error is not None:
            row["dropped"] += 1
        if trial.early_retry is not None and trial.early_retry.status == 409:
            row["early 409"] += 1
        for report in trial.recoveries:
            for outcome in ("released", "completed"):
                row[f"recovered {outcome}"] += report.get(outcome, 0)
        if trial.final is not None and trial.final.status == 201:
            row["final 201"] += 1
            row["final replayed"] += int(trial.final.replayed)
        issues = trial_issues(trial, point, owner, trial_charges, trial_payments, records)
        if issues:
            problems.append(
                "; ".join(issues) + f"\n{trial.describe()}\n  charges: {trial_charges}\n"
                f"  payments: {trial_payments}\n  records: {records}"
            )

    assert not problems, (
        f"{len(problems)} trial(s) at {point} went wrong:\n\n"
        + "\n\n".join(problems[:5])
        + "\n\n"
        + stack.diagnostics()
    )
    counts = {name: row[name] for name, _ in COLUMNS if name not in ("point", "trials")}
    return {**counts, "point": point, "trials": len(trials)}


# -- the table ---------------------------------------------------------------------------------

COLUMNS = [
    ("point", 38),
    ("trials", 6),
    ("dropped", 7),
    ("early 409", 9),
    ("charges", 7),
    ("payments", 8),
    ("completed", 9),
    ("duplicates", 10),
    ("lost", 4),
    ("final 201", 9),
    ("final replayed", 14),
    ("recovered released", 18),
    ("recovered completed", 19),
    ("seconds", 7),
]


def table() -> list[str]:
    header = " | ".join(name.ljust(width) for name, width in COLUMNS)
    lines = [header, "-" * len(header)]
    for row in ROWS:
        lines.append(" | ".join(str(row.get(name, 0)).ljust(width) for name, width in COLUMNS))
    return lines


@pytest.fixture(scope="module", autouse=True)
def print_table() -> Iterator[None]:
    """Hand the table to the end-of-run summary (``tests/live/conftest.py``)."""
    started = time.monotonic()
    yield
    if not ROWS:
        return
    summary_lines.extend(
        [
            f"crash tests: {TRIALS} trials per point, SIGKILL at each point, recovery by a "
            f"Celery worker ({time.monotonic() - started:.1f} s for the module)",
            "dropped: connections the killed worker dropped; early 409: retries at once "
            "refused while the record was held; charges: in the provider's ledger; "
            "duplicates: charges or payments beyond one per key; lost: a charge without its "
            "payment or COMPLETED record; recovered released/completed: the Celery "
            "worker's reports",
            *table(),
        ]
    )


# -- the tests ---------------------------------------------------------------------------------


@pytest.mark.parametrize("point", POINTS)
def test_sigkill_at_point_then_recovery(payments: Lazy[PaymentsStack], point: str) -> None:
    """TRIALS keys killed at ``point``; after recovery each has one charge, one payment."""
    stack = payments.get()
    run = uuid.uuid4().hex[:6]
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=TRIALS, thread_name_prefix=f"trial-{point}") as pool:
        trials = list(pool.map(lambda n: run_trial(stack, point, n, run), range(TRIALS)))
    row = check_trials(stack, point, trials)
    row["seconds"] = f"{time.monotonic() - started:.1f}"
    ROWS.append(row)
    assert row["duplicates"] == 0 and row["lost"] == 0
    assert row["charges"] == row["payments"] == row["completed"] == TRIALS
    assert row["dropped"] == TRIALS
    if point == "after-claim":
        # Nothing external had begun: the claims were released (by recovery,
        # or taken over by the retry itself), and the retries ran the view.
        assert row["recovered completed"] == 0
    elif point == "after-commit":
        assert row["recovered released"] == row["recovered completed"] == 0
        assert row["final replayed"] == TRIALS
    elif point == "after-begin-external":
        # Never charged: the reconciler released them, the retries charged.
        assert row["recovered released"] == TRIALS and row["recovered completed"] == 0
    else:
        # Charged, then killed: the reconciler found every charge.
        assert row["recovered completed"] == TRIALS and row["recovered released"] == 0
        assert row["final replayed"] == TRIALS


@dataclass
class Stall:
    """How the owner is held up past its lease, and what recovery then finds."""

    headers: dict[str, str]
    #: The reconciler's outcome: "released" (no charge yet) or "completed".
    recovery: str


STALLS = {
    # The provider takes 5 s before it charges: recovery finds no charge
    # and releases; the owner's charge then lands, its set_provider_operation
    # is refused, and the client's retry runs the view anew (the provider
    # answers the same charge).
    "slow-provider": Stall({"X-Simulate": "slow", "X-Simulate-Delay": "5"}, "released"),
    # Charged, then stuck before set_provider_operation.
    "stall-after-provider-charge": Stall(
        {"X-Stall-At": "after-provider-charge", "X-Stall-Seconds": "5"}, "completed"
    ),
    # Charged and the Payment written (uncommitted), then stuck before the
    # completion: the completion is refused and the Payment rolls back.
    "stall-after-payment-write": Stall(
        {"X-Stall-At": "after-payment-write", "X-Stall-Seconds": "5"}, "completed"
    ),
}


@pytest.mark.parametrize("variant", list(STALLS))
def test_stale_owner_cannot_overwrite_after_takeover(
    payments: Lazy[PaymentsStack], variant: str
) -> None:
    stack = payments.get()
    stall = STALLS[variant]
    tag = uuid.uuid4().hex[:8]
    key, order_id = f"fencing-{variant}-{tag}", f"ORD-fencing-{variant}-{tag}"
    body = {"order_id": order_id, "amount": 4321, "currency": "EUR"}
    url = stack.url + PAYMENTS
    headers = {**auth(), "Idempotency-Key": key}
    log_offset = stack.server.log_offset()

    started = time.monotonic()
    stale: dict[str, Result] = {}
    owner = threading.Thread(
        target=lambda: stale.setdefault("answer", post(url, body, {**headers, **stall.headers})),
        name=f"stale-owner-{variant}",
    )
    owner.start()
    time.sleep(0.3)  # the owner claims and begins its external call
    assert stack.database.records(key), "the owner did not claim"
    wait_for_lease_expiry(stack, key)
    report = stack.recover()  # takes the record over while the owner is stuck
    owner.join(timeout=30)
    assert not owner.is_alive(), "the stale owner never answered"
    stale_answer = stale["answer"]

    final = None
    deadline = time.monotonic() + SETTLE_DEADLINE
    while time.monotonic() < deadline:
        final = post(url, body, headers)
        if final.status != 409:
            break
        time.sleep(0.2)

    records = stack.database.records(key)
    charges = stack.provider.charges_by_order().get(order_id, [])
    payments_ = payments_for(stack, [order_id])[order_id]
    log = stack.server.log_since(log_offset)
    explain = (
        f"variant={variant} recovery={report}\nstale owner: {stale_answer.describe()}\n"
        f"final: {final.describe() if final else None}\nrecords: {records}\n"
        f"charges: {charges}\npayments: {payments_}\n{stack.diagnostics()}"
    )

    assert report[stall.recovery] == 1, "recovery did not take the record over\n" + explain
    assert stale_answer.status == 409 and error_code(stale_answer) == IN_PROGRESS, (
        "the stale owner's answer must be a 409: its outcome was not stored\n" + explain
    )
    assert "Stale owner" in log, "the refused owner write was not logged\n" + explain
    assert final is not None and final.status == 201, explain
    assert len(charges) == 1, "not exactly one charge\n" + explain
    assert len(payments_) == 1, "not exactly one payment\n" + explain
    assert payments_[0]["provider_charge_id"] == charges[0]["id"], explain
    assert len(records) == 1 and records[0]["state"] == "COMPLETED", explain
    assert records[0]["response_status"] == 201, explain
    assert bytes(records[0]["response_body"]) == final.body, explain
    assert json.loads(final.body)["id"] == payments_[0]["id"], explain
    if stall.recovery == "completed":
        # Recovery's outcome stands, under the token it took over with.
        assert final.replayed and records[0]["fencing_token"] == 2, explain
    else:
        # Released: the retry ran the view again and the provider answered
        # the charge the stale owner had made (a second attempt, one charge).
        assert not final.replayed and charges[0]["attempts"] == 2, explain
    ROWS.append(
        {
            "point": f"fencing: {variant}",
            "trials": 1,
            "charges": len(charges),
            "payments": len(payments_),
            "completed": 1,
            "final 201": 1,
            "final replayed": int(final.replayed),
            f"recovered {stall.recovery}": 1,
            "seconds": f"{time.monotonic() - started:.1f}",
        }
    )


@pytest.mark.parametrize(
    ("mode", "first_status", "charged"),
    [
        ("charge-then-timeout", 502, True),
        ("charge-then-disconnect", 502, True),
        ("fail-before-charge", 502, False),
        ("decline", 402, False),
    ],
)
def test_provider_failure_modes(
    payments: Lazy[PaymentsStack], mode: str, first_status: int, charged: bool
) -> None:
    """The provider fails in a named way; the record and recovery settle it right."""
    stack = payments.get()
    tag = uuid.uuid4().hex[:8]
    key, order_id = f"mode-{mode}-{tag}", f"ORD-mode-{mode}-{tag}"
    body = {"order_id": order_id, "amount": 777, "currency": "EUR"}
    url = stack.url + PAYMENTS
    headers = {**auth(), "Idempotency-Key": key}

    first = post(url, body, {**headers, "X-Simulate": mode, "X-Simulate-Delay": "30"})
    assert first.status == first_status, first.describe()
    retry = post(url, body, headers)
    charges = stack.provider.charges_by_order().get(order_id, [])
    assert len(charges) == (1 if charged else 0), charges

    if mode == "decline":
        # A definitive answer: stored FAILED and replayed, nothing charged.
        assert retry.status == 402 and retry.replayed and retry.body == first.body
        assert stack.database.records(key)[0]["state"] == "FAILED"
        assert not payments_for(stack, [order_id])[order_id]
        return

    # Unknown outcome: UNCERTAIN, 503 until the reconciler asked the provider.
    assert retry.status == 503 and error_code(retry) == OUTCOME_UNCERTAIN, retry.describe()
    assert stack.database.records(key)[0]["state"] == "UNCERTAIN"
    report = stack.recover()
    assert report["completed" if charged else "released"] >= 1, report
    final = post(url, body, headers)
    assert final.status == 201, final.describe()
    # Charged: the reconciler's stored answer. Not charged: released, so the
    # retry ran the view and charged now.
    assert final.replayed == charged
    charges = stack.provider.charges_by_order().get(order_id, [])
    payment = payments_for(stack, [order_id])[order_id]
    assert len(charges) == 1 and len(payment) == 1
    assert payment[0]["provider_charge_id"] == charges[0]["id"]
    assert json.loads(final.body)["id"] == payment[0]["id"]
