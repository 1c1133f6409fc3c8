#!/usr/bin/env python3
"""What an async DRF request costs against a sync one: DRF vs adrf, each with IdempotentMixin.

    .venv/bin/python benchmarks/async_drf.py [--rounds 5] [--duration 8] [--json out.json]

Needs wrk (Debian: ``apt-get install wrk``), adrf (the ``adrf`` extra) and
psycopg-pool (``pip install psycopg-pool``: Django's connection pool, which
the ASGI server uses). uvicorn picks uvloop and httptools when installed
(``pip install uvicorn[standard]``); the report says which it ran.

1. creates a fresh PostgreSQL database (``idem_bench_async_<random>``) on the
   server given by ``IDEMPOTENCY_BENCH_POSTGRES_URL`` (default: the local
   server, user postgres) and migrates the benchmark project into it;
2. starts gunicorn (WSGI, ``--workers`` sync workers, persistent
   connections) and uvicorn (ASGI, as many workers, Django's connection
   pool: under ASGI every request's sync work runs in a thread of its own,
   whose connection ``CONN_MAX_AGE`` cannot keep), both serving
   benchmarks/benchproject on 127.0.0.1;
3. drives, with wrk (``-t2 -c8``, benchmarks/wrk/bench.lua), the views of
   benchmarks/benchapp/async_views.py, each writing one Payment row:

   * under gunicorn, DRF's ``APIView``: ``sync unprotected``, ``sync mixin``
     (with ``IdempotentMixin``, a new key per request: first executions) and
     ``sync mixin replay`` (one key, replayed on every request);
   * under uvicorn, adrf's ``APIView`` with ``async def post``: ``async
     unprotected``, ``async mixin``, ``async mixin replay``; and DRF's sync
     view again, which Django's ASGI handler runs in a thread: ``sync mixin
     (ASGI)`` and its replay;

   interleaved: ``--rounds`` rounds, each running every endpoint for
   ``--duration`` seconds, the order rotating from round to round;
4. prints the requests/s, the p50 and p99 latency and the application's CPU
   per request (the server's processes and threads, read from /proc: the
   figure a machine shared with other work disturbs least) of each
   endpoint, medians over the rounds, and the ratios that answer the
   question (medians of the per-round ratios): async against sync for
   first executions, replays and unprotected requests; and, within each
   stack, what the protection costs (mixin against unprotected);
5. checks what it measured: no error or non-2xx answer, every first
   execution wrote one row, no replay wrote any;
6. stops both servers and drops the database.

Absolute figures vary from run to run and machine to machine; compare the
ratios. Nothing here is asserted by the tests (they assert the statements
each answer sends: tests/test_adrf.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, this file's directory would come first on sys.path: its
# http.py would shadow the standard library's http package.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402
import uuid  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks.benchlib import (  # noqa: E402
    Database,
    Gunicorn,
    Uvicorn,
    load_average,
    machine,
    median,
    migrate,
    postgres_url,
    process_tree_cpu_seconds,
    server_facts,
)

LUA = _HERE / "wrk" / "bench.lua"
BODY = b'{"amount": 1250, "currency": "EUR"}'
TABLES = ("benchapp_payment", "django_idempotency_record")
WRK_ERRORS = ("connect_errors", "read_errors", "write_errors", "status_errors", "timeouts")


@dataclass(frozen=True)
class Endpoint:
    name: str
    server: str  # "wsgi" (gunicorn) or "asgi" (uvicorn)
    path: str
    #: The wrk script's mode: no key, a new key per request, or one fixed key.
    mode: str

    @property
    def writes(self) -> bool:
        return self.mode != "fixed"


SYNC = Endpoint("sync unprotected", "wsgi", "/sync-unprotected", "none")
SYNC_MIXIN = Endpoint("sync mixin", "wsgi", "/sync-mixin", "unique")
SYNC_REPLAY = Endpoint("sync mixin replay", "wsgi", "/sync-mixin", "fixed")
ASYNC = Endpoint("async unprotected", "asgi", "/async-unprotected", "none")
ASYNC_MIXIN = Endpoint("async mixin", "asgi", "/async-mixin", "unique")
ASYNC_REPLAY = Endpoint("async mixin replay", "asgi", "/async-mixin", "fixed")
SYNC_ON_ASGI = Endpoint("sync mixin (ASGI)", "asgi", "/sync-mixin", "unique")
SYNC_ON_ASGI_REPLAY = Endpoint("sync mixin replay (ASGI)", "asgi", "/sync-mixin", "fixed")
ENDPOINTS = (
    SYNC,
    SYNC_MIXIN,
    SYNC_REPLAY,
    ASYNC,
    ASYNC_MIXIN,
    ASYNC_REPLAY,
    SYNC_ON_ASGI,
    SYNC_ON_ASGI_REPLAY,
)

#: (what, endpoint, reference): the ratios printed, of requests/s.
RATIOS = (
    ("first execution: adrf (ASGI) / DRF (WSGI)", ASYNC_MIXIN, SYNC_MIXIN),
    ("replay: adrf (ASGI) / DRF (WSGI)", ASYNC_REPLAY, SYNC_REPLAY),
    ("unprotected: adrf (ASGI) / DRF (WSGI)", ASYNC, SYNC),
    ("protection, DRF (WSGI): first execution / unprotected", SYNC_MIXIN, SYNC),
    ("protection, adrf (ASGI): first execution / unprotected", ASYNC_MIXIN, ASYNC),
    ("protection, DRF (WSGI): replay / unprotected", SYNC_REPLAY, SYNC),
    ("protection, adrf (ASGI): replay / unprotected", ASYNC_REPLAY, ASYNC),
    ("under ASGI, first execution: adrf / DRF in a thread", ASYNC_MIXIN, SYNC_ON_ASGI),
    ("under ASGI, replay: adrf / DRF in a thread", ASYNC_REPLAY, SYNC_ON_ASGI_REPLAY),
)


@dataclass
class Run:
    endpoint: str
    round: int
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    #: The application server's CPU per request (master, workers, their threads).
    cpu_ms: float
    requests: int
    rows_written: int
    errors: int


@dataclass
class Results:
    runs: list[Run] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def of(self, endpoint: Endpoint) -> list[Run]:
        return [run for run in self.runs if run.endpoint == endpoint.name]

    def ratio(
        self, endpoint: Endpoint, reference: Endpoint, figure: str = "requests_per_s"
    ) -> float:
        """Median over the rounds of this round's ratio of ``figure``."""
        by_round = {run.round: getattr(run, figure) for run in self.of(reference)}
        return median([getattr(run, figure) / by_round[run.round] for run in self.of(endpoint)])


def wrk(url: str, endpoint: Endpoint, args: argparse.Namespace, prefix: str) -> dict[str, Any]:
    seconds = args.duration
    command = [
        "wrk", f"-t{args.threads}", f"-c{args.connections}", f"-d{seconds:g}s",
        "--timeout", "5s", "-s", str(LUA), url + endpoint.path, "--", endpoint.mode, prefix,
    ]  # fmt: skip
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=seconds + 60, check=False
    )
    for line in result.stdout.splitlines():
        if line.startswith("BENCH "):
            return dict(json.loads(line[len("BENCH ") :]))
    raise RuntimeError(f"wrk printed no result:\n{result.stdout}\n{result.stderr}")


def post(url: str, key: str) -> tuple[int, Any, bytes]:
    """(status, headers, body); the headers are looked up case-insensitively."""
    headers = {"Content-Type": "application/json", "Idempotency-Key": key}
    request = urllib.request.Request(url, data=BODY, method="POST", headers=headers)
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.status, response.headers, response.read()


def prepare_replay(url: str, key: str) -> None:
    """One first execution, then check that its retry is a byte-identical replay."""
    first, again = post(url, key), post(url, key)
    if (first[0], again[0], again[1].get("Idempotent-Replayed")) != (201, 201, "true"):
        raise RuntimeError(f"{url}: no replay: {first} then {again}")
    if first[2] != again[2]:
        raise RuntimeError(f"{url}: the replayed body differs: {first[2]!r} {again[2]!r}")


def rows(connection: Any) -> int:
    return int(
        connection.execute("SELECT coalesce(max(id), 0) FROM benchapp_payment").fetchone()[0]
    )


def settle(connection: Any, quiet: float = 1.0, limit: float = 30.0) -> None:
    """Wait until the requests wrk left queued when it stopped have run."""
    deadline, last = time.monotonic() + limit, rows(connection)
    while time.monotonic() < deadline:
        time.sleep(quiet)
        now = rows(connection)
        if now == last:
            return
        last = now


def measure(
    args: argparse.Namespace, urls: dict[str, str], pids: dict[str, int], database: Database
) -> Results:
    results = Results()
    run_id = uuid.uuid4().hex[:8]
    replay_keys = {e.name: f"{run_id}-replay-{e.server}{e.path}" for e in ENDPOINTS}
    for endpoint in ENDPOINTS:
        if endpoint.mode == "fixed":
            prepare_replay(urls[endpoint.server] + endpoint.path, replay_keys[endpoint.name])

    def load(endpoint: Endpoint, label: str) -> dict[str, Any]:
        fixed = endpoint.mode == "fixed"
        prefix = replay_keys[endpoint.name] if fixed else f"{run_id}-{label}-{endpoint.name}"
        return wrk(urls[endpoint.server], endpoint, args, prefix.replace(" ", "-"))

    with database.connect() as connection:
        print(f"warm-up: {args.duration:g} s per endpoint", flush=True)
        for endpoint in ENDPOINTS:
            load(endpoint, "warm")
        for round_ in range(1, args.rounds + 1):
            shift = (round_ - 1) % len(ENDPOINTS)
            for endpoint in ENDPOINTS[shift:] + ENDPOINTS[:shift]:
                settle(connection)
                for table in TABLES:
                    connection.execute(f"VACUUM (ANALYZE) {table}")
                before = rows(connection)
                cpu_before = process_tree_cpu_seconds(pids[endpoint.server])
                outcome = load(endpoint, f"r{round_}")
                cpu = process_tree_cpu_seconds(pids[endpoint.server]) - cpu_before
                errors = sum(int(outcome[name]) for name in WRK_ERRORS)
                run = Run(
                    endpoint=endpoint.name,
                    round=round_,
                    requests_per_s=outcome["requests"] / (outcome["duration_us"] / 1e6),
                    p50_ms=outcome["p50_us"] / 1000,
                    p99_ms=outcome["p99_us"] / 1000,
                    cpu_ms=1000 * cpu / max(1, int(outcome["requests"])),
                    requests=int(outcome["requests"]),
                    rows_written=rows(connection) - before,
                    errors=errors,
                )
                results.runs.append(run)
                check(run, endpoint, args.connections, results)
                print(
                    f"round {round_}  {endpoint.name:<26} {run.requests_per_s:8.1f} req/s  "
                    f"p50 {run.p50_ms:6.2f} ms  p99 {run.p99_ms:6.2f} ms  "
                    f"CPU {run.cpu_ms:5.2f} ms/request  "
                    f"({run.requests} requests, {run.rows_written} rows, {run.errors} errors)",
                    flush=True,
                )
    return results


def check(run: Run, endpoint: Endpoint, connections: int, results: Results) -> None:
    where = f"round {run.round}, {endpoint.name}"
    if run.errors:
        results.problems.append(f"{where}: {run.errors} errors or non-2xx answers")
    if endpoint.writes:
        # Requests cut off when wrk stops were executed but not counted.
        if not run.requests <= run.rows_written <= run.requests + connections:
            results.problems.append(
                f"{where}: {run.requests} requests but {run.rows_written} payment rows"
            )
    elif run.rows_written:
        results.problems.append(f"{where}: replays wrote {run.rows_written} payment rows")


def report(results: Results, args: argparse.Namespace, facts: dict[str, str]) -> dict[str, Any]:
    summary: dict[str, Any] = {"facts": facts, "endpoints": {}, "ratios": {}}
    print()
    print(
        f"{args.rounds} rounds x {args.duration:g} s per endpoint, wrk -t{args.threads} "
        f"-c{args.connections}; gunicorn {args.workers} sync workers; uvicorn {args.workers} "
        f"workers ({facts['uvicorn']}), Django's connection pool"
    )
    header = (
        f"{'endpoint':<28}{'server':>8}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'CPU ms/request':>16}"
    )
    print(header)
    print("-" * len(header))
    for endpoint in ENDPOINTS:
        runs = results.of(endpoint)
        figures = {
            "requests_per_s": median([run.requests_per_s for run in runs]),
            "p50_ms": median([run.p50_ms for run in runs]),
            "p99_ms": median([run.p99_ms for run in runs]),
            "cpu_ms": median([run.cpu_ms for run in runs]),
            "per_round_requests_per_s": [round(run.requests_per_s, 1) for run in runs],
        }
        summary["endpoints"][endpoint.name] = figures
        server = "gunicorn" if endpoint.server == "wsgi" else "uvicorn"
        print(
            f"{endpoint.name:<28}{server:>8}{figures['requests_per_s']:9.1f}"
            f"{figures['p50_ms']:9.2f}{figures['p99_ms']:9.2f}{figures['cpu_ms']:16.2f}"
        )
    print()
    print("ratios (medians of the per-round ratios):")
    print(f"  {'':<58}{'req/s':>8}{'CPU/request':>13}")
    for what, endpoint, reference in RATIOS:
        throughput = results.ratio(endpoint, reference)
        cpu = results.ratio(endpoint, reference, "cpu_ms")
        summary["ratios"][what] = {"requests_per_s": throughput, "cpu_ms": cpu}
        print(f"  {what:<58}{throughput:7.2f}x{cpu:12.2f}x")
    if results.problems:
        print("\nPROBLEMS:")
        for problem in results.problems:
            print(f"  {problem}")
    summary["problems"] = results.problems
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per endpoint run")
    parser.add_argument("--threads", type=int, default=2, help="wrk threads")
    parser.add_argument("--connections", type=int, default=8, help="wrk connections")
    parser.add_argument("--workers", type=int, default=2, help="workers of each server")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    missing = [
        what
        for what, present in (
            ("wrk (Debian: apt-get install wrk)", shutil.which("wrk")),
            ('adrf (pip install "django-idempotency[adrf]")', importlib.util.find_spec("adrf")),
            ("psycopg-pool (pip install psycopg-pool)", importlib.util.find_spec("psycopg_pool")),
        )
        if not present
    ]
    if missing:
        print("missing: " + "; ".join(missing), file=sys.stderr)
        return 2

    facts = machine()
    facts["uvicorn"] = Uvicorn.loop_and_http()
    started = time.monotonic()
    with Database(postgres_url(), "idem_bench_async") as database:
        with database.connect() as connection:
            facts.update(server_facts(connection))
        migrate(database)
        facts["load_before"] = load_average()
        print(
            f"{facts['cpus']} x {facts['cpu']}, {facts['memory']}, Python {facts['python']}, "
            f"PostgreSQL {facts['server_version']}, commit {facts['commit']}; "
            f"load average {facts['load_before']}",
            flush=True,
        )
        pool = {"IDEMPOTENCY_BENCH_POOL": "1"}
        with (
            Gunicorn(database, workers=args.workers) as wsgi,
            Uvicorn(database, workers=args.workers, env=pool) as asgi,
        ):
            assert wsgi.process is not None and asgi.process is not None
            urls = {"wsgi": wsgi.url, "asgi": asgi.url}
            pids = {"wsgi": wsgi.process.pid, "asgi": asgi.process.pid}
            results = measure(args, urls, pids, database)
            results.problems.extend(f"gunicorn log: {line}" for line in wsgi.problems()[:10])
            results.problems.extend(f"uvicorn log: {line}" for line in asgi.problems()[:10])
        facts["load_after"] = load_average()
    facts["elapsed_s"] = f"{time.monotonic() - started:.0f}"
    summary = report(results, args, facts)
    print(
        f"\nload average before {facts['load_before']}, after {facts['load_after']}; "
        f"wall time {facts['elapsed_s']} s"
    )
    if args.json:
        summary["runs"] = [vars(run) for run in results.runs]
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 1 if results.problems else 0


if __name__ == "__main__":
    sys.exit(main())
