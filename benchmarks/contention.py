#!/usr/bin/env python3
"""Contention: 50 simultaneous same-key requests, default mode against optimistic.

    .venv/bin/python benchmarks/contention.py [--keys 10] [--duplicates 50] [--work 0.05]

In the default (two-commit) mode the first request claims
the key and runs the view once; the duplicates that arrive meanwhile are
answered 409 at once (``IN_FLIGHT = "conflict"``, the default) and replay
once it is done. In the optimistic mode (``@idempotent(optimistic=True)``)
nothing is claimed first: every duplicate that arrives before the winner
commits runs the view body too, then rolls back and answers the winner's
replay (or 409 when it gave up waiting, after ``IN_FLIGHT_WAIT``).

1. creates a fresh PostgreSQL database (``idem_bench_contention_<random>``)
   on the server ``IDEMPOTENCY_BENCH_POSTGRES_URL`` names (default: the local
   server) and migrates the test project into it (tests/settings.py, with
   IN_FLIGHT from the environment: tests/live/optimistic_settings.py; the
   views measured are tests/testapp/optimistic_live_views.py);
2. starts gunicorn, one server per IN_FLIGHT setting, one after the other,
   with gthread workers (``--workers`` x ``--threads``, default 4 x 16 = 64
   request threads, each with its own database connection) so that all 50
   duplicates are served at the same time;
3. per key, sends ``--duplicates`` POSTs with one Idempotency-Key and body
   at once (one thread and one TCP connection each, released by a barrier),
   to each case the server serves in turn (interleaved, the order rotating
   from key to key):

   * ``default``: the orders view, ``@idempotent``, once with ``IN_FLIGHT =
     "conflict"`` (the default: duplicates answered 409 at once) and once
     with ``"wait"`` (they wait for the outcome and replay it);
   * ``optimistic``: the same view, ``@idempotent(optimistic=True)``: the
     duplicates collide on the Order's unique number in the view body;
   * ``optimistic, no business key``: a Charge only, so the duplicates get
     as far as the record's INSERT;

   each with the view body taking ``--work`` seconds inside its transaction
   (a sleep), ``before`` the business write (the bodies overlap, then
   collide) and ``after`` it (the winner holds its rows; the others wait);
4. prints per case: the view bodies run per key (every run appends a line
   to a file outside its transaction, so those rolled back count too), the
   answers (201 first, 201 replay, 409, other), the winner's latency and the
   losers' p50 / p99 / max, from the barrier's release to the answer;
5. checks one business row and one record per key (printed, not asserted);
6. stops gunicorn and drops the database.

Figures, not assertions: they vary with the machine and its load.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, this file's directory would come first on sys.path, and
# benchmarks/http.py would shadow the standard library's http package.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import argparse  # noqa: E402
import contextlib  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from collections import Counter, defaultdict  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any  # noqa: E402

import requests  # noqa: E402

from benchmarks.benchlib import (  # noqa: E402
    Database,
    Gunicorn,
    load_average,
    machine,
    median,
    migrate,
    percentile,
    postgres_url,
    server_facts,
)

#: tests.settings, with IN_FLIGHT from the environment (IDEMPOTENCY_IN_FLIGHT).
SETTINGS = "tests.live.optimistic_settings"
APP = "tests.live.wsgi:application"
READY_PATH = "/api-view/charges"  # a GET the test project answers 200
#: optimistic_live_views.BODIES_RUN_LOG_ENV (importing it would need Django set up).
BODIES_RUN_LOG_ENV = "TESTAPP_BODIES_RUN_LOG"


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    #: Where the body's work goes: "sleep" before the business write, "hold" after it.
    work_field: str
    #: The server's IN_FLIGHT (the default mode's duplicates: 409 at once, or wait).
    in_flight: str

    @property
    def label(self) -> str:
        where = "before" if self.work_field == "sleep" else "after"
        name = f"{self.name} ({self.in_flight})" if self.name == "default" else self.name
        return f"{name}, work {where} the write"


def cases(in_flight: str) -> tuple[Case, ...]:
    """What a server with this IN_FLIGHT serves: the optimistic cases once, on "wait"."""
    views = [("default", "/optimistic/orders-default")]
    if in_flight == "wait":  # the optimistic mode does not read IN_FLIGHT
        views += [
            ("optimistic", "/optimistic/orders"),
            ("optimistic, no business key", "/optimistic/notes"),
        ]
    return tuple(
        Case(name, path, work_field, in_flight)
        for work_field in ("sleep", "hold")
        for name, path in views
    )


IN_FLIGHT_MODES = ("conflict", "wait")


def table_order(case: Case) -> tuple[bool, bool, bool, str]:
    """Work before the write first; then default (conflict, wait), optimistic."""
    default = case.name == "default"
    return (case.work_field != "sleep", not default, case.in_flight != "conflict", case.name)


@dataclass
class Answer:
    status: int | None = None
    replayed: bool = False
    elapsed: float = 0.0
    error: str | None = None

    @property
    def kind(self) -> str:
        if self.error is not None:
            return "error"
        if self.status == 201:
            return "201 replay" if self.replayed else "201 first"
        if self.status == 409:
            return "409"
        return f"other ({self.status})"


@dataclass
class Tally:
    bodies: list[int] = field(default_factory=list)
    #: Per key, from the first body run's start to the last one's.
    spreads: list[float] = field(default_factory=list)
    kinds: Counter[str] = field(default_factory=Counter)
    winners: list[float] = field(default_factory=list)
    losers: list[float] = field(default_factory=list)
    by_kind: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    wrong: list[str] = field(default_factory=list)


def gthread_server(
    database: Database, workers: int, threads: int, bodies_log: Path, in_flight: str
) -> Gunicorn:
    """benchlib's Gunicorn, serving the test project with gthread workers."""
    return Gunicorn(
        database,
        workers,
        threads=threads,
        app=APP,
        settings=SETTINGS,
        env={BODIES_RUN_LOG_ENV: str(bodies_log), "IDEMPOTENCY_IN_FLIGHT": in_flight},
        ready_path=READY_PATH,
    )


def fire_together(url: str, body: dict[str, Any], key: str, count: int) -> list[Answer]:
    """``count`` POSTs released together: one thread and one connection each."""
    answers = [Answer() for _ in range(count)]
    barrier = threading.Barrier(count, timeout=30)

    def send(answer: Answer) -> None:
        try:
            with requests.Session() as session:
                barrier.wait()
                started = time.perf_counter()
                response = session.post(
                    url, json=body, headers={"Idempotency-Key": key}, timeout=30
                )
                answer.elapsed = time.perf_counter() - started
                answer.status = response.status_code
                answer.replayed = response.headers.get("Idempotent-Replayed") == "true"
        except Exception as exc:  # reported in the table, never lost in a thread
            answer.error = f"{type(exc).__name__}: {exc}"

    threads = [threading.Thread(target=send, args=(answer,)) for answer in answers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return answers


def body_starts(log: Path, key: str) -> list[float]:
    """When each body run for ``key`` started (wall clock, from the servers' log)."""
    fields = (line.split(" ") for line in log.read_text().splitlines() if line)
    return [float(parts[3]) for parts in fields if parts[0] == key]


def storm(server: Gunicorn, case: Case, work: float, duplicates: int, tally: Tally | None) -> None:
    """One key's storm against one case; ``tally`` None: a warm-up, not counted."""
    tag = uuid.uuid4().hex[:12]
    key, number = f"contention-{tag}", f"ORD-{tag}"
    body = {"order": number, "amount": 100, case.work_field: work}
    answers = fire_together(server.url + case.path, body, key, duplicates)
    if tally is None:
        return
    starts = body_starts(Path(server.env[BODIES_RUN_LOG_ENV]), key)
    tally.bodies.append(len(starts))
    tally.spreads.append(max(starts) - min(starts) if starts else 0.0)
    for answer in answers:
        tally.kinds[answer.kind] += 1
        if answer.kind == "201 first":
            tally.winners.append(answer.elapsed)
        else:
            tally.losers.append(answer.elapsed)
            tally.by_kind[answer.kind].append(answer.elapsed)
    with server.database.connect() as connection:
        charges = connection.execute(
            "SELECT count(*) FROM testapp_charge WHERE note = %s", [number]
        ).fetchone()
        records = connection.execute(
            "SELECT count(*) FROM django_idempotency_record "
            "WHERE \"key\" = %s AND state = 'COMPLETED'",
            [key],
        ).fetchone()
    firsts = sum(answer.kind == "201 first" for answer in answers)
    if (charges, records, firsts) != ((1,), (1,), 1):
        tally.wrong.append(f"{key}: {charges} charges, {records} records, {firsts} first 201s")


def milliseconds(values: list[float], fraction: float | None = None) -> str:
    if not values:
        return "-"
    if fraction is None:
        return f"{max(values) * 1000:.0f}"
    return f"{percentile(values, fraction) * 1000:.0f}"


def report(tallies: dict[Case, Tally], duplicates: int) -> None:
    header = (
        f"{'case':<52} {'bodies run/key':>17} {'201 first':>9} {'201 replay':>10} {'409':>5} "
        f"{'other':>5}  {'winner p50/max ms':>17}  {'losers p50/p99/max ms':>21}"
    )
    print(header)
    print("-" * len(header))
    for case, tally in tallies.items():
        bodies = (
            f"{min(tally.bodies)}/{median(tally.bodies):g}/{max(tally.bodies)}"
            if tally.bodies
            else "-"
        )
        other = sum(
            n for kind, n in tally.kinds.items() if kind not in ("201 first", "201 replay", "409")
        )
        winner = f"{milliseconds(tally.winners, 0.5)}/{milliseconds(tally.winners)}"
        losers = (
            f"{milliseconds(tally.losers, 0.5)}/{milliseconds(tally.losers, 0.99)}/"
            f"{milliseconds(tally.losers)}"
        )
        print(
            f"{case.label:<52} {bodies:>17} {tally.kinds['201 first']:>9} "
            f"{tally.kinds['201 replay']:>10} {tally.kinds['409']:>5} {other:>5}  "
            f"{winner:>17}  {losers:>21}"
        )
    print("(bodies run/key: min/median/max over the keys; latencies from the barrier's release)")
    print()
    print("how far apart the bodies of one key started (first to last), median/max ms:")
    for case, tally in tallies.items():
        if max(tally.bodies, default=0) > 1:
            spread = f"{milliseconds(tally.spreads, 0.5)}/{milliseconds(tally.spreads)}"
            print(f"  {case.label:<52} {spread}")
    print()
    print("losers by answer, p50/p99/max ms:")
    for case, tally in tallies.items():
        parts = [
            f"{kind} ({len(values)}): {milliseconds(values, 0.5)}/{milliseconds(values, 0.99)}/"
            f"{milliseconds(values)}"
            for kind, values in sorted(tally.by_kind.items())
        ]
        print(f"  {case.label:<52} {'; '.join(parts)}")
    problems = [line for tally in tallies.values() for line in tally.wrong]
    errors = sum(tally.kinds["error"] for tally in tallies.values())
    print()
    print(
        f"checks: {len(problems)} keys without exactly one business row and one COMPLETED "
        f"record, {errors} requests without an HTTP answer (of {duplicates} per key)"
    )
    for line in problems[:10]:
        print(f"  {line}")


@contextlib.contextmanager
def serving(
    database: Database, args: argparse.Namespace, bodies_log: Path, in_flight: str
) -> Iterator[Gunicorn]:
    with gthread_server(database, args.workers, args.threads, bodies_log, in_flight) as server:
        yield server
        problems = server.problems()
        if problems:
            print(f"\nserver log problems ({len(problems)}), first 10:")
            for line in problems[:10]:
                print(f"  {line}")


def measure(server: Gunicorn, in_flight: str, args: argparse.Namespace) -> dict[Case, Tally]:
    """Every case a server with ``in_flight`` serves, ``args.keys`` storms each, interleaved."""
    served = cases(in_flight)
    for case in served:  # warm every worker's imports and each path
        storm(server, case, args.work, args.duplicates, None)
    tallies: dict[Case, Tally] = {case: Tally() for case in served}
    for index in range(args.keys):
        shift = index % len(served)
        for case in served[shift:] + served[:shift]:
            storm(server, case, args.work, args.duplicates, tallies[case])
    return tallies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=10, help="keys (storms) per case")
    parser.add_argument("--duplicates", type=int, default=50, help="same-key requests per storm")
    parser.add_argument("--work", type=float, default=0.05, help="seconds of body work")
    parser.add_argument("--workers", type=int, default=4, help="gunicorn processes")
    parser.add_argument("--threads", type=int, default=16, help="gthread threads per process")
    parser.add_argument("--keep", action="store_true", help="keep the database")
    args = parser.parse_args()
    slots = args.workers * args.threads
    if slots < args.duplicates:
        parser.error(f"{slots} request threads cannot serve {args.duplicates} requests at once")

    facts = machine()
    print(
        f"machine: {facts['cpus']} CPUs, {facts['cpu']}, {facts['memory']}, "
        f"Python {facts['python']}, commit {facts['commit']}, load {load_average()}"
    )
    started = time.monotonic()
    tallies: dict[Case, Tally] = {}
    with Database(postgres_url(), "idem_bench_contention", keep=args.keep) as database:
        migrate(database, SETTINGS)
        with database.connect() as connection:
            print(f"PostgreSQL: {server_facts(connection)}")
        print(
            f"gunicorn: {args.workers} gthread workers x {args.threads} threads = {slots} "
            f"requests served at once (CONN_MAX_AGE=0: a connection per request); "
            f"{args.duplicates} duplicates per key, {args.keys} keys per case, "
            f"body work {args.work * 1000:.0f} ms inside the transaction; IN_FLIGHT_WAIT=10 s; "
            f"one server with IN_FLIGHT='conflict' (the default), then one with 'wait'"
        )
        with tempfile.TemporaryDirectory(prefix="idem-contention-") as log_dir:
            bodies_log = Path(log_dir) / "bodies-run.log"
            bodies_log.touch()
            for in_flight in IN_FLIGHT_MODES:
                with serving(database, args, bodies_log, in_flight) as server:
                    tallies.update(measure(server, in_flight, args))
    print()
    report(dict(sorted(tallies.items(), key=lambda item: table_order(item[0]))), args.duplicates)
    print(f"\nran in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
