"""Prometheus scrapes gunicorn's workers and counts every replay exactly once.

The deployment Django teams run: gunicorn with several worker processes,
prometheus_client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``, a
fresh directory; ``child_exit`` marks dead workers, from
``tests.live.prometheus_gunicorn``), ``IDEMPOTENCY["METRICS"] =
("prometheus",)`` (``tests.live.prometheus_settings``) and
``django_idempotency.prometheus.metrics_view`` at ``/metrics``
(``tests.testapp.urls``). A real Prometheus server (Debian's
``prometheus``) scrapes it every second, and the test reads what Grafana
and the alert rules would read: PromQL over the HTTP API.

Each scrape lands on whichever worker accepts it, and requests on any
other: the sums must still rise by exactly the executions and replays
sent, and a worker killed with SIGKILL must not take its counts with it.
Which worker served which request is read from gunicorn's access log
(``pid=<pid>``); the test sends until at least two workers served replays.

The census gauges, set by another process (``observe_records`` run by a
management command, as a Celery worker would), are scraped from the web
workers. The rules of docs/prometheus/alerts.yml are loaded into the
server and must evaluate without error on the live metrics; so must every
query of the Grafana dashboard (docs/grafana/django-idempotency.json).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.live.prometheus_docs import ALERT_RULES, dashboard_queries
from tests.live.prometheus_server import PrometheusServer, poll, require_binary
from tests.live.server import (
    DEFAULT_APP,
    Call,
    Lazy,
    LiveServer,
    Project,
    Result,
    fire_together,
    live_server,
)
from tests.live.services import require_postgres

pytestmark = [pytest.mark.postgres, pytest.mark.live]

WORKERS = 3
PATH = "/api-view/charges"
#: Replays sent at once per round: more than the workers, so that a busy
#: worker leaves some to the others.
REPLAYS_PER_ROUND = 3 * WORKERS
#: Rounds of replays at most before giving up on two workers serving them.
MAX_ROUNDS = 20

PROMETHEUS_PROJECT = Project(
    settings="tests.live.prometheus_settings", app=DEFAULT_APP, ready_path=PATH
)
ACCESS_LINE = re.compile(r"access pid=<?(\d+)>? \"POST [^\"]*\" (\d+) .* key=(\S+) replayed=(\S+)")


@dataclass
class Stack:
    server: LiveServer
    prometheus: PrometheusServer
    multiprocess_dir: Path

    def total(self, outcome: str) -> float:
        """The sum over all series of ``idempotency_requests_total{outcome=...}``, last scraped.

        Each series' last sample of the last 10 seconds, rather than the
        instant vector: a scrape that timed out on a loaded machine marks
        the series stale, and the sum would vanish until the next one.
        """
        value = self.prometheus.scalar(
            f'sum(last_over_time(idempotency_requests_total{{outcome="{outcome}"}}[10s]))'
        )
        return 0.0 if value is None else value

    def settle(self) -> None:
        """Wait until Prometheus stored a scrape begun after everything sent so far."""
        self.prometheus.wait_for_scrapes_after(time.time())

    def explain(self, what: str) -> str:
        return "\n".join(
            [
                what,
                f"multiprocess files: {sorted(p.name for p in self.multiprocess_dir.iterdir())}",
                self.server.diagnostics(),
                self.prometheus.diagnostics(),
            ]
        )


@contextlib.contextmanager
def prometheus_stack() -> Iterator[Stack]:
    """gunicorn (3 workers, multiprocess metrics) on a fresh database, scraped by Prometheus."""
    multiprocess_dir = Path(tempfile.mkdtemp(prefix="idem-prom-multiproc-"))
    try:
        with live_server(
            require_postgres(),
            workers=WORKERS,
            project=PROMETHEUS_PROJECT,
            extra_env={"PROMETHEUS_MULTIPROC_DIR": str(multiprocess_dir)},
            extra_args=["-c", "python:tests.live.prometheus_gunicorn"],
        ) as server:
            prometheus = PrometheusServer(
                f"127.0.0.1:{server.port}", metrics_path="/metrics", rule_files=[ALERT_RULES]
            )
            with prometheus:
                prometheus.wait_until(
                    lambda: prometheus.scalar(f'up{{job="{prometheus.job}"}}') == 1,
                    "scraped the app successfully",
                )
                yield Stack(server, prometheus, multiprocess_dir)
    finally:
        shutil.rmtree(multiprocess_dir, ignore_errors=True)


def require_services() -> None:
    require_binary("prometheus")
    require_postgres()


@pytest.fixture(scope="module")
def stack() -> Iterator[Lazy[Stack]]:
    lazy = Lazy(prometheus_stack, require_services)
    try:
        yield lazy
    finally:
        lazy.close()


# -- requests ---------------------------------------------------------------------------


def new_key() -> str:
    return f"prom-{uuid.uuid4().hex[:12]}"


def first_executions(stack: Stack, count: int) -> list[str]:
    """``count`` new keys, each executed once (201, not a replay); the keys."""
    keys = [new_key() for _ in range(count)]
    calls = [
        Call(stack.server.url + PATH, {"amount": 100, "note": key}, {"Idempotency-Key": key})
        for key in keys
    ]
    results = fire_together(calls)
    bad = [r.describe() for r in results if r.status != 201 or r.replayed]
    assert not bad, stack.explain(f"first executions not answered 201: {bad}")
    return keys


def replays(stack: Stack, keys: list[str], count: int) -> list[Result]:
    """``count`` replays of ``keys`` (round robin), sent at once, each on its own connection."""
    calls = [
        Call(stack.server.url + PATH, {"amount": 100, "note": key}, {"Idempotency-Key": key})
        for key in (keys[i % len(keys)] for i in range(count))
    ]
    results = fire_together(calls)
    bad = [r.describe() for r in results if r.status != 201 or not r.replayed]
    assert not bad, stack.explain(f"replays not answered 201 Idempotent-Replayed: {bad}")
    return results


def replays_by_pid(stack: Stack, log_offset: int) -> Counter[int]:
    """Replays per worker pid in gunicorn's access log since ``log_offset``."""
    served: Counter[int] = Counter()
    for match in ACCESS_LINE.finditer(stack.server.log_since(log_offset)):
        if match[4] == "true":
            served[int(match[1])] += 1
    return served


def replays_on_two_workers(stack: Stack, keys: list[str]) -> tuple[int, Counter[int]]:
    """Rounds of simultaneous replays until two workers or more served some.

    The kernel hands each connection to one of the workers waiting in
    ``accept()``; which one is not ours to choose. Returns the replays sent
    and the replays per pid.
    """
    offset = stack.server.log_offset()
    sent = 0
    served: Counter[int] = Counter()
    for _ in range(MAX_ROUNDS):
        sent += len(replays(stack, keys, REPLAYS_PER_ROUND))
        served = logged_replays(stack, offset, sent)
        if len(served) >= 2:
            return sent, served
    raise AssertionError(stack.explain(f"{sent} replays all served by one worker: {dict(served)}"))


def logged_replays(stack: Stack, offset: int, sent: int) -> Counter[int]:
    """Replays per pid once the access log shows all ``sent`` (logged after the answer)."""
    served: Counter[int] = Counter()

    def all_logged() -> bool:
        served.clear()
        served.update(replays_by_pid(stack, offset))
        return sum(served.values()) >= sent

    poll(all_logged, f"gunicorn never logged {sent} replays", 30, stack.server.diagnostics)
    assert sum(served.values()) == sent, stack.explain(
        f"the access log shows {dict(served)} replays, {sent} sent"
    )
    return served


# -- the tests --------------------------------------------------------------------------


def test_replays_and_executions_counted_exactly_whichever_worker_served(
    stack: Lazy[Stack],
) -> None:
    live = stack.get()
    # A baseline Prometheus has seen: one execution and one replay first,
    # so that both series exist (an absent series and 0 look alike).
    warm_up = first_executions(live, 1)
    replays(live, warm_up, 1)
    live.settle()
    executed_before, replayed_before = live.total("executed"), live.total("replayed")
    assert executed_before >= 1 and replayed_before >= 1, live.explain(
        f"no baseline: executed={executed_before} replayed={replayed_before}"
    )

    executions = 5
    keys = first_executions(live, executions)
    sent, served = replays_on_two_workers(live, keys)
    live.settle()

    executed, replayed = live.total("executed"), live.total("replayed")
    print(
        f"\n[prometheus] {executions} executions and {sent} replays over workers "
        f"{dict(served)}: executed {executed_before:.0f} -> {executed:.0f}, "
        f"replayed {replayed_before:.0f} -> {replayed:.0f}"
    )
    assert replayed - replayed_before == sent, live.explain(
        f"replayed rose by {replayed - replayed_before}, {sent} replays were sent ({dict(served)})"
    )
    assert executed - executed_before == executions, live.explain(
        f"executed rose by {executed - executed_before}, {executions} first requests were sent"
    )


def test_a_killed_workers_replays_stay_counted(stack: Lazy[Stack]) -> None:
    live = stack.get()
    keys = first_executions(live, 3)
    live.settle()
    replayed_before = live.total("replayed")
    sent, served = replays_on_two_workers(live, keys)
    live.settle()
    assert live.total("replayed") - replayed_before == sent, live.explain("replays miscounted")

    victim, victim_replays = served.most_common(1)[0]
    booted = live.server.log_text().count("Booting worker with pid")
    os.kill(victim, signal.SIGKILL)
    # gunicorn's master reaps it (child_exit runs) and boots a replacement.
    poll(
        lambda: live.server.log_text().count("Booting worker with pid") > booted,
        f"gunicorn never replaced the killed worker {victim}",
        60,
        live.server.diagnostics,
    )
    live.settle()
    after_kill = live.total("replayed")
    assert after_kill - replayed_before == sent, live.explain(
        f"after SIGKILL of worker {victim} (served {victim_replays} replays) the replay sum "
        f"went from {replayed_before + sent:.0f} to {after_kill:.0f}"
    )

    more, served_after = replays_on_two_workers(live, keys)
    live.settle()
    print(
        f"\n[prometheus] worker {victim} killed after {victim_replays} of {sent} replays "
        f"({dict(served)}): replayed stayed at {after_kill:.0f}; {more} more replays "
        f"({dict(served_after)}): {live.total('replayed'):.0f}"
    )
    assert victim not in served_after, live.explain(f"the killed worker {victim} served requests")
    assert live.total("replayed") - after_kill == more, live.explain(
        f"{more} replays after the kill counted as {live.total('replayed') - after_kill}"
    )


def test_the_census_taken_by_another_process_is_scraped_from_the_web_workers(
    stack: Lazy[Stack],
) -> None:
    """The gauges as in production: set by the process running ``observe_records``.

    Here a management command's process with the same PROMETHEUS_MULTIPROC_DIR,
    gone before the scrape (``mostrecent`` gauges outlive it), and read from
    whichever gunicorn worker answers the scrape.
    """
    live = stack.get()
    first_executions(live, 2)
    database_now = "SELECT extract(epoch FROM clock_timestamp())::float8"
    before = float(live.server.database.query(database_now)[0][0])
    live.server.manage(
        "shell",
        "-c",
        "from django_idempotency.tasks import observe_records; observe_records()",
    )
    after = float(live.server.database.query(database_now)[0][0])
    live.settle()

    rows = live.server.database.query(
        "SELECT state, count(*) FROM django_idempotency_record GROUP BY state"
    )
    counts = {str(state): int(count) for state, count in rows}
    assert counts.get("COMPLETED", 0) >= 2
    for state in ("COMPLETED", "CLAIMED", "UNCERTAIN"):
        scraped = live.prometheus.scalar(
            f'max(idempotency_records{{database="default",state="{state}"}})'
        )
        assert scraped == counts.get(state, 0), live.explain(
            f"{state}: Prometheus has {scraped}, the database {counts.get(state, 0)}"
        )
    taken = live.prometheus.scalar('max(idempotency_census_timestamp_seconds{database="default"})')
    assert taken is not None and before <= taken <= after, live.explain(
        f"census timestamp {taken} not within the command's run [{before}, {after}]"
    )
    age = live.prometheus.scalar(
        'max(idempotency_oldest_unresolved_age_seconds{database="default",state="UNCERTAIN"})'
    )
    assert age == 0, live.explain(f"no UNCERTAIN record, yet the oldest is {age} s old")


def test_alert_rules_and_dashboard_queries_evaluate_on_live_metrics(stack: Lazy[Stack]) -> None:
    live = stack.get()
    first_executions(live, 1)
    live.settle()

    def every_rule_evaluated() -> bool:
        rules = [r for g in live.prometheus.api("rules")["groups"] for r in g["rules"]]
        return bool(rules) and all(r["health"] != "unknown" for r in rules)

    live.prometheus.wait_until(every_rule_evaluated, "evaluated every alert rule")
    groups = live.prometheus.api("rules")["groups"]
    assert [g["name"] for g in groups] == ["django-idempotency"]
    broken = {r["name"]: r.get("lastError") for r in groups[0]["rules"] if r["health"] != "ok"}
    assert not broken, live.explain(f"rules that fail on live metrics: {broken}")

    failed = {}
    for expr in dashboard_queries(rate_interval="1m"):
        try:
            live.prometheus.query(expr)
        except RuntimeError as exc:
            failed[expr] = str(exc)
    assert not failed, f"dashboard queries Prometheus refuses: {failed}"
