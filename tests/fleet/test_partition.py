"""A host cut off the network mid-request (its veth down), not killed.

The host's processes live on: its request waits for the provider's answer
inside the view's transaction (holding the payer's row lock), its
connections to PostgreSQL hang silently, no RST either way. Two cases, on
the fleet of ``tests/fleet/hosts.py`` (lease 5 s; the bounds are the
``SERVER_SETTINGS`` and ``CLIENT_SETTINGS`` there):

**Healed in time.** fleet-h3 is cut while its request sits in a slow
provider call. Meanwhile:

- the record stays IN_PROGRESS, its lease owner naming fleet-h3;
- duplicates sent to the other hosts get 409
  ``idempotency_request_in_progress`` with ``Retry-After``, at once: never
  a 5xx, never a second charge;
- once the lease is over, the other hosts' beats take the record over and
  settle it from the provider's ledger: a duplicate then gets the 201, as
  a replay;
- when the partition heals, fleet-h3's request wakes up with the
  provider's answer and tries to finish: the fencing token refuses it.
  The record keeps the settled answer and its token, one payment, one
  charge.

**Never healed in time.** fleet-h3 is cut while holding the payer's row
lock and stays cut. The server notices the dead peer by its TCP keepalives
and drops fleet-h3's backends: their locks go with them. The test measures
how long that took against the bound (idle + interval x count), how long
another payment of the same payer (another key, another host) waited for
the lock, and that the key is answered (replayed) once recovery settled it.

Figures (lock hold times, waits) go to the terminal summary.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import pytest
import requests

from tests.fleet.clients import body, headers
from tests.fleet.conftest import summary_lines
from tests.fleet.hosts import LEASE, SERVER_SETTINGS, Fleet, FleetHost
from tests.live.celery_harness import wait_until
from tests.live.server import Lazy

pytestmark = [pytest.mark.fleet]

SLOW_DELAY = 3.0
#: The server drops a silent client after about this many seconds.
KEEPALIVE_BOUND = int(SERVER_SETTINGS["tcp_keepalives_idle"]) + int(
    SERVER_SETTINGS["tcp_keepalives_interval"]
) * int(SERVER_SETTINGS["tcp_keepalives_count"])
#: Generous: a loaded 2-core machine; the assertion is about the order of magnitude.
SLACK = 15.0
#: A duplicate is answered at once in the conflict mode; bound it generously.
DUPLICATE_BOUND = 10.0
#: The hosts' IN_FLIGHT_WAIT (tests/fleet/fleet_settings.py).
IN_FLIGHT_WAIT = 3.0
#: How long the held view holds its record's lock, unless cut.
HELD_FOR = 8.0


@dataclass
class Answer:
    host: str
    status: int | None
    code: str
    retry_after: str | None
    replayed: bool
    body: bytes
    elapsed: float
    at: float


def send(host: FleetHost, token: str, key: str, order: str, since: float, **kw: Any) -> Answer:
    begun = time.monotonic()
    try:
        response = requests.post(
            host.url + "/v1/payments",
            json=body(order),
            headers=headers(token, key, kw.get("slow_delay")),
            timeout=kw.get("timeout", 60),
        )
    except requests.RequestException as exc:
        return Answer(host.name, None, type(exc).__name__, None, False, b"", 0, begun - since)
    code = ""
    if response.headers.get("Content-Type", "").startswith("application/json"):
        code = str(response.json().get("code", "")) if isinstance(response.json(), dict) else ""
    return Answer(
        host.name,
        response.status_code,
        code,
        response.headers.get("Retry-After"),
        response.headers.get("Idempotent-Replayed") == "true",
        response.content,
        time.monotonic() - begun,
        begun - since,
    )


def record(fleet: Fleet, key: str) -> dict[str, Any] | None:
    rows = fleet.query(
        "SELECT state, lease_owner, lease_expires_at, fencing_token, response_status, "
        'response_body FROM django_idempotency_record WHERE "key" = %s',
        [key],
    )
    if not rows:
        return None
    names = ["state", "lease_owner", "lease_expires_at", "token", "status", "body"]
    return dict(zip(names, rows[0], strict=True))


def backends(fleet: Fleet, host: FleetHost) -> dict[int, tuple[str, int]]:
    """The host's backends on the server: pid -> (state, locks granted)."""
    rows = fleet.admin(
        "SELECT a.pid, a.state, (SELECT count(*) FROM pg_locks l WHERE l.pid = a.pid AND l.granted)"
        " FROM pg_stat_activity a WHERE host(a.client_addr) = %s",
        [host.host.address],
    )
    return {int(pid): (str(state), int(locks)) for pid, state, locks in rows}


def holding(fleet: Fleet, host: FleetHost) -> dict[int, int]:
    """The host's backends that hold row or relation locks besides their own transaction id."""
    return {pid: locks for pid, (state, locks) in backends(fleet, host).items() if locks > 1}


def start_in_thread(target: Any) -> tuple[threading.Thread, list[Answer]]:
    out: list[Answer] = []
    thread = threading.Thread(target=lambda: out.append(target()))
    thread.start()
    return thread, out


def wait_in_provider_call(fleet: Fleet, key: str, host: FleetHost) -> dict[str, Any]:
    """Until the record is IN_PROGRESS under ``host`` and the host holds locks on the server."""
    wait_until(
        lambda: (
            (r := record(fleet, key)) is not None
            and r["state"] == "IN_PROGRESS"
            and bool(holding(fleet, host))
        ),
        30,
        lambda: f"{record(fleet, key)} {backends(fleet, host)}\n{fleet.diagnostics()}",
        step=0.05,
    )
    # The provider call has gone out (it follows the intent's commit at once).
    time.sleep(0.3)
    found = record(fleet, key)
    assert found is not None
    return found


def test_partitioned_host_is_fenced_out_after_the_takeover(the_fleet: Lazy[Fleet]) -> None:
    fleet = the_fleet.get()
    cut, others = fleet.hosts[2], fleet.hosts[:2]
    token = fleet.tokens[-1]
    run = uuid.uuid4().hex[:8]
    key, order = f"cut-{run}", f"order-cut-{run}"
    since = time.monotonic()

    first, first_out = start_in_thread(
        lambda: send(cut, token, key, order, since, slow_delay=SLOW_DELAY)
    )
    before = wait_in_provider_call(fleet, key, cut)
    assert before["lease_owner"].startswith(f"{cut.name}:"), before
    held_before = holding(fleet, cut)
    fleet.network.partition(cut.host)
    cut_at = time.monotonic()
    duplicates: list[Answer] = []
    stop = threading.Event()

    def send_duplicates() -> None:
        # Duplicates on the other hosts until one gets the settled answer.
        deadline = time.monotonic() + LEASE + KEEPALIVE_BOUND + SLACK
        while time.monotonic() < deadline and not stop.is_set():
            answer = send(others[len(duplicates) % 2], token, key, order, since, timeout=60)
            duplicates.append(answer)
            if answer.status == 201:
                return
            time.sleep(0.5)

    sender = threading.Thread(target=send_duplicates)
    healed_at = None
    try:
        during = record(fleet, key)
        assert during is not None and during["state"] == "IN_PROGRESS"
        assert during["lease_owner"] == before["lease_owner"]
        sender.start()
        # Heal once the lease ran out and recovery took the record over,
        # before the server's keepalives would drop the cut host's backend.
        wait_until(
            lambda: (r := record(fleet, key)) is not None and r["token"] > before["token"],
            LEASE + 20,
            lambda: str(record(fleet, key)),
        )
        taken_over_at = time.monotonic()
        taken_over = record(fleet, key)
        locks_while_cut = holding(fleet, cut)
        time.sleep(1.0)
        fleet.network.heal(cut.host)
        healed_at = time.monotonic()
        sender.join(timeout=LEASE + KEEPALIVE_BOUND + SLACK + 60)
    finally:
        stop.set()
        if healed_at is None:
            fleet.network.heal(cut.host)
    settled = record(fleet, key)
    first.join(timeout=60)
    wait_until(lambda: not holding(fleet, cut), 30, lambda: str(backends(fleet, cut)))
    locks_released = time.monotonic()
    after = record(fleet, key)

    charges = fleet.provider.charges_by_order().get(order, [])
    payments = fleet.query("SELECT count(*) FROM payments_payment WHERE order_id = %s", [order])
    late = first_out[0] if first_out else None
    summary_lines.append("test_partition, healed in time:")
    summary_lines.extend(
        f"  {line}"
        for line in [
            f"cut {cut.name} {cut_at - since:.1f}s after its request began "
            f"(IN_PROGRESS, lease owner {before['lease_owner']}, token {before['token']})",
            f"its backends held locks while cut: {locks_while_cut or held_before}",
            "duplicates on the other hosts: "
            + ", ".join(f"{a.status}{'R' if a.replayed else ''}@{a.at:.1f}s" for a in duplicates),
            f"slowest duplicate answer: {max(a.elapsed for a in duplicates):.2f}s "
            f"(bound: IN_FLIGHT_WAIT, {IN_FLIGHT_WAIT}s)",
            f"taken over by recovery {taken_over_at - cut_at:.1f}s after the cut: "
            f"{taken_over and taken_over['state']} "
            f"owner {taken_over and taken_over['lease_owner']} "
            f"token {taken_over and taken_over['token']}",
            f"healed after {healed_at - cut_at:.1f}s; cut host's late answer: "
            f"{late and late.status} {late and late.body[:120]!r}",
            f"cut host's locks released {locks_released - healed_at:.1f}s after healing",
            f"charges {len(charges)}, payments {payments[0][0]}, record {after and after['state']} "
            f"token {after and after['token']}",
        ]
    )
    context = fleet.diagnostics()
    assert held_before, "the cut host held no locks: not cut inside its transaction"
    assert duplicates and duplicates[-1].status == 201 and duplicates[-1].replayed, (
        duplicates,
        context,
    )
    for answer in duplicates[:-1]:
        assert answer.status == 409 and answer.code == "idempotency_request_in_progress", answer
        assert answer.retry_after is not None, answer
    # A duplicate answers at once, or, when it meets the record while
    # another transaction holds it (a takeover waiting on the cut host's row
    # lock), after at most IN_FLIGHT_WAIT: never until the server drops the
    # dead backend (KEEPALIVE_BOUND).
    assert all(a.elapsed <= DUPLICATE_BOUND for a in duplicates), duplicates
    # The takeover waited for the lease.
    assert taken_over_at - cut_at >= LEASE - 1.0
    assert settled is not None and settled["state"] == "COMPLETED"
    assert settled["token"] > before["token"]
    # The late completion changed nothing.
    assert after == settled, (after, settled)
    # The cut host never answers success: its late writes were refused
    # (409), or its provider call timed out meanwhile (502).
    assert late is not None and late.status in (409, 502, 503), late
    assert len(charges) == 1
    assert payments[0][0] == 1
    retry = send(others[0], token, key, order, since)
    assert retry.status == 201 and retry.replayed and retry.body == duplicates[-1].body


def test_server_drops_a_dead_hosts_backends_and_their_locks(the_fleet: Lazy[Fleet]) -> None:
    fleet = the_fleet.get()
    cut, others = fleet.hosts[2], fleet.hosts[:2]
    token = fleet.tokens[-2]
    run = uuid.uuid4().hex[:8]
    key, order = f"dead-{run}", f"order-dead-{run}"
    since = time.monotonic()

    first, _ = start_in_thread(lambda: send(cut, token, key, order, since, slow_delay=SLOW_DELAY))
    before = wait_in_provider_call(fleet, key, cut)
    held = holding(fleet, cut)
    fleet.network.partition(cut.host)
    cut_at = time.monotonic()
    try:
        # Another payment of the same payer, on another host: it needs the
        # payer's row, locked by the dead host's open transaction.
        other_key = f"dead-other-{run}"
        blocked, blocked_out = start_in_thread(
            lambda: send(others[0], token, other_key, f"order-other-{run}", since, timeout=90)
        )
        duplicate = send(others[1], token, key, order, since, timeout=30)
        # And one after the lease ran out, when recovery has taken the
        # record and waits on the same row lock.
        time.sleep(max(0.0, cut_at + LEASE + 2 - time.monotonic()))
        late_duplicate, late_out = start_in_thread(
            lambda: send(others[1], token, key, order, since, timeout=90)
        )
        # Who waits on a lock, and on which statement, while the cut host's
        # backend lives on (for the figures).
        time.sleep(2.0)
        waiting = fleet.admin(
            "SELECT host(client_addr), wait_event, "
            "left(regexp_replace(query, '\\s+', ' ', 'g'), 90) FROM pg_stat_activity "
            "WHERE wait_event_type = 'Lock' ORDER BY client_addr"
        )
        wait_until(
            lambda: not holding(fleet, cut),
            KEEPALIVE_BOUND + SLACK + 30,
            lambda: f"{backends(fleet, cut)}\n{fleet.postgres.log_tail()}",
        )
        dropped_after = time.monotonic() - cut_at
        blocked.join(timeout=90)
        late_duplicate.join(timeout=90)
        # The record is settled by recovery (the provider did charge), and
        # the key answers again.
        wait_until(
            lambda: (r := record(fleet, key)) is not None and r["state"] == "COMPLETED",
            30,
            lambda: str(record(fleet, key)),
        )
        retry = send(others[0], token, key, order, since)
    finally:
        fleet.network.heal(cut.host)
    first.join(timeout=60)
    log = fleet.postgres.log_path.read_text(errors="replace")
    other = blocked_out[0] if blocked_out else None
    late = late_out[0] if late_out else None
    summary_lines.append("test_partition, never healed in time:")
    summary_lines.extend(
        f"  {line}"
        for line in [
            f"cut {cut.name} holding {sum(held.values())} locks in {len(held)} backend(s) "
            f"(record {before['state']}, lease owner {before['lease_owner']})",
            f"duplicate meanwhile: {duplicate.status} {duplicate.code} Retry-After "
            f"{duplicate.retry_after} in {duplicate.elapsed:.2f}s",
            f"server dropped the dead backends after {dropped_after:.1f}s "
            f"(keepalive bound {KEEPALIVE_BOUND}s, idle_in_transaction_session_timeout "
            f"{SERVER_SETTINGS['idle_in_transaction_session_timeout']})",
            f"same payer, other key, other host: {other and other.status} {other and other.code} "
            f"after {other and other.elapsed:.1f}s (waited on the payer's row lock)",
            *(f"meanwhile waiting on a lock: {row}" for row in waiting),
            f"duplicate after the lease: {late and late.status} "
            f"replayed={late and late.replayed} after {late and late.elapsed:.1f}s",
            f"the key afterwards: {retry.status} replayed={retry.replayed}",
        ]
    )
    assert held, "the cut host held no locks"
    assert duplicate.status == 409 and duplicate.retry_after is not None, duplicate
    assert duplicate.elapsed <= DUPLICATE_BOUND
    assert dropped_after <= KEEPALIVE_BOUND + SLACK, (dropped_after, log[-2000:])
    # It waited on the lock for longer than its own lease: if recovery
    # released its claim meanwhile, the fencing token refused its result
    # (409, nothing stored) and the client's retry runs it again.
    assert other is not None and other.status in (201, 409), other
    assert other.elapsed <= KEEPALIVE_BOUND + SLACK + 5
    other_retry = send(others[0], token, other_key, f"order-other-{run}", since)
    assert other_retry.status == 201, other_retry
    other_payments = fleet.query(
        "SELECT count(*) FROM payments_payment WHERE order_id = %s", [f"order-other-{run}"]
    )
    assert other_payments[0][0] == 1
    assert late is not None and late.status in (201, 409), late
    # Recovery has taken the record and its transaction waits on the payer's
    # row (its reconciler's writes): the duplicate's claim waits on that
    # transaction at most IN_FLIGHT_WAIT, then 409, not until the server
    # drops the dead backend.
    assert late.elapsed <= DUPLICATE_BOUND, late
    assert retry.status == 201 and retry.replayed
    charges = fleet.provider.charges_by_order().get(order, [])
    assert len(charges) == 1


def test_dead_hosts_record_lock_holds_duplicates_at_most_in_flight_wait(
    the_fleet: Lazy[Fleet],
) -> None:
    fleet = the_fleet.get()
    cut, others = fleet.hosts[2], fleet.hosts[:2]
    token = fleet.tokens[-3]
    run = uuid.uuid4().hex[:8]
    key = f"held-{run}"
    since = time.monotonic()

    def post_held(host: FleetHost, hold: float = 0.0, timeout: float = 60) -> Answer:
        begun = time.monotonic()
        try:
            response = requests.post(
                host.url + "/fleet/held",
                json={"order_id": key},
                headers={**headers(token, key), "X-Fleet-Hold": str(hold)},
                timeout=timeout,
            )
        except requests.RequestException as exc:
            return Answer(host.name, None, type(exc).__name__, None, False, b"", 0, begun - since)
        code = response.json().get("code", "") if response.status_code >= 400 else ""
        return Answer(
            host.name,
            response.status_code,
            str(code),
            response.headers.get("Retry-After"),
            response.headers.get("Idempotent-Replayed") == "true",
            response.content,
            time.monotonic() - begun,
            begun - since,
        )

    first, first_out = start_in_thread(lambda: post_held(cut, hold=HELD_FOR))
    # The claim is an uncommitted INSERT: visible only as the cut host's locks.
    wait_until(lambda: bool(holding(fleet, cut)), 30, lambda: str(backends(fleet, cut)), 0.05)
    held = holding(fleet, cut)
    fleet.network.partition(cut.host)
    cut_at = time.monotonic()
    try:
        duplicate = post_held(others[0])
        wait_until(
            lambda: not holding(fleet, cut),
            KEEPALIVE_BOUND + SLACK + 30,
            lambda: f"{backends(fleet, cut)}\n{fleet.postgres.log_tail()}",
        )
        dropped_after = time.monotonic() - cut_at
        retry = post_held(others[1])
        again = post_held(others[0])
    finally:
        fleet.network.heal(cut.host)
    first.join(timeout=90)
    late = first_out[0] if first_out else None
    rows = fleet.query(
        'SELECT state, response_status FROM django_idempotency_record WHERE "key" = %s', [key]
    )
    summary_lines.append("test_partition, cut while holding the record's lock:")
    summary_lines.extend(
        f"  {line}"
        for line in [
            f"cut {cut.name} holding {sum(held.values())} locks (its claim, uncommitted)",
            f"duplicate meanwhile: {duplicate.status} {duplicate.code} Retry-After "
            f"{duplicate.retry_after} after {duplicate.elapsed:.2f}s "
            f"(IN_FLIGHT_WAIT {IN_FLIGHT_WAIT}s)",
            f"server dropped the dead backend after {dropped_after:.1f}s "
            f"(keepalive bound {KEEPALIVE_BOUND}s)",
            f"the key then: {retry.status} replayed={retry.replayed}, "
            f"asked again: {again.status} replayed={again.replayed}",
            f"the cut host's own answer after healing: {late and late.status}",
            f"records for the key: {rows}",
        ]
    )
    assert held
    assert duplicate.status == 409 and duplicate.retry_after is not None, duplicate
    assert duplicate.elapsed <= IN_FLIGHT_WAIT + SLACK, duplicate
    assert dropped_after <= KEEPALIVE_BOUND + SLACK
    assert retry.status == 201 and not retry.replayed, retry
    assert again.status == 201 and again.replayed and again.body == retry.body, again
    assert late is not None and late.status != 201, late
    assert rows == [("COMPLETED", 201)]
