"""Three hosts behind nginx that resends slow POSTs; one host killed and brought back.

The fleet (``tests/fleet/hosts.py``): three network namespaces, each with
its own address and hostname, running gunicorn (the demo's payments API),
a Celery worker and its own ``celery beat`` (three beats at once, on
purpose); PostgreSQL, Redis and the provider simulator on the bridge;
nginx (``tests/fleet/balancer.py``) in front, resending a POST that got no
answer within 1.5 s to another host (``proxy_next_upstream ...
non_idempotent``).

Clients, one user each, pay orders, each under a key of its own, a third
of them asking the provider to be slow (2.5 s, longer than nginx waits):
nginx sends those twice. In the middle, once two more (slow) payments sent
straight to one host are inside their provider call there, every process
of that host is SIGKILLed (all pids of its namespace); the host is started
again 6 s later. Those two clients retry through nginx.
The clients retry as ``tests/fleet/clients.py`` says (same key, backoff,
``Retry-After``).

Proved, once the beats' recovery has settled what the dead host left:

- provider charges = payments = COMPLETED records = keys, no order charged
  twice, no record unresolved;
- every client got an answer, and asking again gave the same bytes,
  marked as a replay;
- the records the kill left IN_PROGRESS were settled by recovery, and the
  three beats' recoveries committed exactly one settlement per record
  they settled (``tests/fleet/recovery_audit.py`` logs each);
- the hosts saw their own hostnames (the workers' names carry them).

A figures table is printed in the terminal summary.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from tests.fleet.balancer import READ_TIMEOUT, Nginx
from tests.fleet.clients import Payment, body, headers, pay
from tests.fleet.conftest import summary_lines
from tests.fleet.hosts import APP_PORT, Fleet
from tests.live.celery_harness import wait_until
from tests.live.server import Lazy

pytestmark = [pytest.mark.fleet]

CLIENTS = 8
PAYMENTS_PER_CLIENT = 6
#: Slower than nginx's proxy_read_timeout: nginx resends these.
SLOW_DELAY = READ_TIMEOUT + 1.0
#: Payments sent straight to the victim and caught inside the provider call
#: by the kill: recovery must settle them.
ORPHANS = 2
KILL_AFTER = 5.0
DOWN_FOR = 6.0
CLIENT_DEADLINE = 90.0
SETTLE_TIMEOUT = 40.0


def unresolved(fleet: Fleet) -> int:
    rows = fleet.query(
        "SELECT count(*) FROM django_idempotency_record WHERE state NOT IN ('COMPLETED', 'FAILED')"
    )
    return int(rows[0][0])


def audit(path: Path) -> list[dict[str, object]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def test_fleet_behind_a_resending_balancer_survives_a_host_killed(
    the_fleet: Lazy[Fleet],
) -> None:
    fleet = the_fleet.get()
    started = time.monotonic()
    nginx = Nginx(fleet.log_dir, [f"{host.host.address}:{APP_PORT}" for host in fleet.hosts])
    run = uuid.uuid4().hex[:8]
    victim = fleet.hosts[1]
    events: dict[str, float] = {}
    killed: list[int] = []
    orphan_pool = ThreadPoolExecutor(ORPHANS)
    orphans: list[Future[Payment]] = []

    def client(index: int) -> list[Payment]:
        token = fleet.tokens[index]
        done = []
        for n in range(PAYMENTS_PER_CLIENT):
            slow = SLOW_DELAY if (index + n) % 3 == 0 else None
            done.append(
                pay(
                    nginx.url,
                    token,
                    f"fleet-{run}-{index}-{n}",
                    f"order-{run}-{index}-{n}",
                    slow_delay=slow,
                    deadline=time.monotonic() + CLIENT_DEADLINE,
                )
            )
        return done

    def orphan(index: int) -> Payment:
        """A payment sent straight to the victim, caught in its provider call by the kill.

        Its client then retries through the balancer, as a client whose
        connection dropped would.
        """
        token = fleet.tokens[CLIENTS + index]
        key, order = f"fleet-{run}-orphan-{index}", f"order-{run}-orphan-{index}"
        with contextlib.suppress(requests.RequestException):
            requests.post(
                victim.url + "/v1/payments",
                json=body(order),
                headers=headers(token, key, SLOW_DELAY),
                timeout=30,
            )
        return pay(
            nginx.url,
            token,
            key,
            order,
            slow_delay=None,
            deadline=time.monotonic() + CLIENT_DEADLINE,
        )

    def in_provider_call_on_victim() -> bool:
        rows = fleet.query(
            'SELECT count(*) FROM django_idempotency_record WHERE "key" LIKE %s '
            "AND state = 'IN_PROGRESS' AND lease_owner LIKE %s",
            [f"fleet-{run}-orphan-%", f"{victim.name}:%"],
        )
        return int(rows[0][0]) == ORPHANS

    def chaos() -> None:
        time.sleep(KILL_AFTER)
        orphans.extend(orphan_pool.submit(orphan, i) for i in range(ORPHANS))
        wait_until(in_provider_call_on_victim, 20, fleet.diagnostics, step=0.05)
        events["kill"] = time.monotonic() - started
        killed.extend(victim.kill())
        time.sleep(DOWN_FOR)
        events["restart"] = time.monotonic() - started
        victim.start()
        events["back"] = time.monotonic() - started

    try:
        nginx.start()
        chaos_thread = threading.Thread(target=chaos)
        chaos_thread.start()
        with ThreadPoolExecutor(CLIENTS) as pool:
            payments = [p for done in pool.map(client, range(CLIENTS)) for p in done]
        chaos_thread.join(timeout=120)
        payments.extend(future.result(timeout=CLIENT_DEADLINE + 60) for future in orphans)
        clients_done = time.monotonic() - started
        wait_until(lambda: unresolved(fleet) == 0, SETTLE_TIMEOUT, fleet.diagnostics)
        settled_at = time.monotonic() - started

        keys = {p.key for p in payments}
        charges = fleet.provider.charges_by_order()
        ours = {order: found for order, found in charges.items() if run in order}
        payment_rows = int(
            fleet.query(
                "SELECT count(*) FROM payments_payment WHERE order_id LIKE %s", [f"%{run}%"]
            )[0][0]
        )
        records = Counter(
            state
            for (state,) in fleet.query(
                'SELECT state FROM django_idempotency_record WHERE "key" LIKE %s', [f"%{run}%"]
            )
        )
        lines = audit(fleet.audit_log)
        settled = Counter(line["record"] for line in lines if line["event"] == "settled")
        asked = Counter(line["record"] for line in lines if line["event"] == "asked")
        passages = [p for p in nginx.passages() if run in p.key]
        attempts = [a for p in payments for a in (*p.attempts, *p.replay_attempts)]
        statuses = Counter(a.status for a in attempts)
        replays = sum(1 for a in attempts if a.replayed)

        figures = {
            "keys (clients x payments + caught by the kill)": (
                f"{CLIENTS} x {PAYMENTS_PER_CLIENT} + {ORPHANS} = {len(keys)}"
            ),
            "requests through nginx (incl. retries, asking again)": len(attempts),
            "nginx passages / resent to another host": (
                f"{len(passages)} / {sum(p.resent for p in passages)}"
            ),
            "answers 201 / 409 / 5xx / no answer": (
                f"{statuses[201]} / {statuses[409]} / "
                f"{sum(n for s, n in statuses.items() if s and s >= 500)} / {statuses[None]}"
            ),
            "replays (Idempotent-Replayed: true)": replays,
            "provider charges / payments / COMPLETED records": (
                f"{sum(len(v) for v in ours.values())} / {payment_rows} / {records['COMPLETED']}"
            ),
            "orders charged twice": sum(1 for v in ours.values() if len(v) > 1),
            "recovery runs (three beats, three workers)": sum(
                len(re.findall(r"recover_stale_records\[\S+\] succeeded", h.worker.log_text()))
                for h in fleet.hosts
            ),
            "recovery: records asked / settled / most settlements per record": (
                f"{len(asked)} / {len(settled)} / {max(settled.values(), default=0)}"
            ),
            "host killed (pids)": f"{victim.name} ({len(killed)} processes)",
            "kill / restart / back at": (
                f"{events.get('kill', 0):.1f}s / {events.get('restart', 0):.1f}s / "
                f"{events.get('back', 0):.1f}s"
            ),
            "clients done / all settled at": f"{clients_done:.1f}s / {settled_at:.1f}s",
            "slowest payment (client's view)": f"{max(p.duration for p in payments):.1f}s",
        }
        summary_lines.append("test_fleet:")
        summary_lines.extend(f"  {name:<62} {value}" for name, value in figures.items())

        context = fleet.diagnostics() + nginx.diagnostics()
        assert all(p.answer is not None for p in payments), [
            (p.key, p.attempts[-3:]) for p in payments if p.answer is None
        ]
        odd = [(p.key, p.answer, p.attempts) for p in payments if p.answer and p.answer[0] != 201]
        assert not odd, odd
        for p in payments:
            assert p.replay is not None and p.answer is not None
            assert p.replay[0] == p.answer[0] and p.replay[1] == p.answer[1], (p, context)
            assert p.replay[2], p
        assert len(ours) == len(keys), (sorted(ours), context)
        assert all(len(found) == 1 for found in ours.values()), ours
        assert payment_rows == len(keys)
        assert records == Counter({"COMPLETED": len(keys)}), records
        assert unresolved(fleet) == 0
        # The orphans' records were left IN_PROGRESS by the kill: recovery
        # (three beats, three workers) settled each of them exactly once.
        orphan_records = {
            int(pk)
            for (pk,) in fleet.query(
                'SELECT id FROM django_idempotency_record WHERE "key" LIKE %s',
                [f"fleet-{run}-orphan-%"],
            )
        }
        assert orphan_records <= set(settled), (orphan_records, settled, lines)
        assert max(settled.values(), default=0) == 1, settled
        # The scenario happened: nginx resent, and clients met the first copy.
        assert sum(p.resent for p in passages) > 0
        assert statuses[409] > 0
        assert killed
        for host in fleet.hosts:
            assert f"@{host.name} ready." in host.worker.log_text(), host.name
    finally:
        orphan_pool.shutdown(wait=False, cancel_futures=True)
        nginx.stop()
