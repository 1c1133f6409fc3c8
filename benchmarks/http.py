#!/usr/bin/env python3
"""HTTP throughput and latency: unprotected, @idempotent, and a hand-written floor.

    .venv/bin/python benchmarks/http.py [--rounds 6] [--duration 10] [--json out.json]

1. creates a fresh PostgreSQL database (``idem_bench_http_<random>``) on the
   server given by ``IDEMPOTENCY_BENCH_POSTGRES_URL`` (default: the local
   server, user postgres) and migrates the benchmark project into it
   (benchmarks/benchproject, benchmarks/benchapp: nothing from the tests);
2. starts gunicorn on 127.0.0.1 (2 sync workers, no access log);
3. drives five endpoints with wrk (``-t2 -c8``, benchmarks/wrk/bench.lua), all
   making the same business write (one INSERT into ``benchapp_payment``):

   * ``unprotected``: the bare DRF view;
   * ``protected``: the same view under ``@idempotent``, a new key per request
     (first executions);
   * ``protected replay``: one key and body, replayed on every request;
   * ``floor``: the same view under a minimal correct idempotency in raw SQL
     (see benchapp/views.py), a new key per request;
   * ``floor replay``: the floor's replay;
   * with ``--single-transaction`` also ``single transaction``: the view under
     ``@idempotent(single_transaction=True)``, first executions (issue 7, item
     5: target >= 0.85x unprotected), and ``floor single``: that design
     written by hand in raw SQL (benchapp/views.py), its ceiling;

   interleaved in one run: ``--rounds`` rounds, each running every endpoint
   for ``--duration`` seconds, the order rotating from round to round. Before
   each run the three tables are vacuumed and analysed (this server may run
   without autovacuum; in production autovacuum does it), outside the timing;
4. prints requests/s and the p50 and p99 latency of each endpoint (medians
   over the rounds), the ratios against the unprotected endpoint and the
   floor (medians of the per-round ratios), and whether the targets of issue
   7 are met: first execution >= 0.9x the floor, replay >= 1.0x unprotected;
5. checks what it measured: no error or non-2xx answer, every first execution
   wrote one row, no replay wrote any;
6. stops gunicorn and drops the database.

Needs wrk (Debian: ``apt-get install wrk``). Absolute figures vary from run
to run and machine to machine; compare the ratios.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, this file's directory would come first on sys.path, and
# this file (http.py) would shadow the standard library's http package.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import argparse  # noqa: E402
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
    load_average,
    machine,
    median,
    migrate,
    postgres_url,
    server_facts,
)

LUA = _HERE / "wrk" / "bench.lua"
BODY = b'{"amount": 1250, "currency": "EUR"}'
TABLES = ("benchapp_payment", "benchapp_floorrecord", "django_idempotency_record")


@dataclass(frozen=True)
class Endpoint:
    name: str
    path: str
    #: The wrk script's mode: no key, a new key per request, or one fixed key.
    mode: str
    #: Whether every request runs the view (one new payment row each).
    writes: bool


UNPROTECTED = Endpoint("unprotected", "/unprotected", "none", True)
PROTECTED = Endpoint("protected", "/protected", "unique", True)
PROTECTED_REPLAY = Endpoint("protected replay", "/protected", "fixed", False)
FLOOR = Endpoint("floor", "/floor", "unique", True)
FLOOR_REPLAY = Endpoint("floor replay", "/floor", "fixed", False)
#: Only with --single-transaction: @idempotent(single_transaction=True), first executions.
SINGLE = Endpoint("single transaction", "/protected-single", "unique", True)
FLOOR_SINGLE = Endpoint("floor single", "/floor-single", "unique", True)
ENDPOINTS = (UNPROTECTED, PROTECTED, PROTECTED_REPLAY, FLOOR, FLOOR_REPLAY)

#: (endpoint, reference, target ratio of requests/s) from issue 7.
TARGETS = (
    (PROTECTED, FLOOR, 0.90),
    (PROTECTED_REPLAY, UNPROTECTED, 1.00),
    (SINGLE, UNPROTECTED, 0.85),
)


def endpoints(args: argparse.Namespace) -> tuple[Endpoint, ...]:
    return (*ENDPOINTS, SINGLE, FLOOR_SINGLE) if args.single_transaction else ENDPOINTS


@dataclass
class Run:
    endpoint: str
    round: int
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    requests: int
    rows_written: int
    errors: int


@dataclass
class Results:
    runs: list[Run] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def of(self, endpoint: Endpoint) -> list[Run]:
        return [run for run in self.runs if run.endpoint == endpoint.name]

    def rounds(self) -> list[int]:
        return sorted({run.round for run in self.runs})

    def ratio(self, endpoint: Endpoint, reference: Endpoint) -> float:
        """Median over the rounds of this round's req/s ratio."""
        by_round = {run.round: run.requests_per_s for run in self.of(reference)}
        return median([run.requests_per_s / by_round[run.round] for run in self.of(endpoint)])


def wrk(
    url: str, endpoint: Endpoint, *, seconds: float, threads: int, connections: int, prefix: str
) -> dict[str, Any]:
    command = [
        "wrk", f"-t{threads}", f"-c{connections}", f"-d{seconds:g}s", "--timeout", "5s",
        "-s", str(LUA), url + endpoint.path, "--", endpoint.mode, prefix,
    ]  # fmt: skip
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=seconds + 60, check=False
    )
    for line in result.stdout.splitlines():
        if line.startswith("BENCH "):
            return dict(json.loads(line[len("BENCH ") :]))
    raise RuntimeError(
        f"wrk printed no result ({result.returncode}):\n{result.stdout}\n{result.stderr}"
    )


def post(url: str, key: str) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(
        url,
        data=BODY,
        method="POST",
        headers={"Content-Type": "application/json", "Idempotency-Key": key},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.status, dict(response.headers), response.read()


def prepare_replays(server: Gunicorn, keys: dict[str, str]) -> None:
    """One first execution per replayed key, then check that a retry is a replay."""
    for endpoint in (PROTECTED_REPLAY, FLOOR_REPLAY):
        url = server.url + endpoint.path
        first = post(url, keys[endpoint.name])
        again = post(url, keys[endpoint.name])
        if first[0] != 201 or again[0] != 201 or again[1].get("Idempotent-Replayed") != "true":
            raise RuntimeError(f"{endpoint.name}: no replay: {first} then {again}")
        if first[2] != again[2]:
            raise RuntimeError(f"{endpoint.name}: replayed body differs: {first[2]!r} {again[2]!r}")


def last_payment_id(connection: Any) -> int:
    row = connection.execute("SELECT coalesce(max(id), 0) FROM benchapp_payment").fetchone()
    return int(row[0])


def settle(connection: Any, quiet: float = 0.5, limit: float = 30.0) -> None:
    """Wait until the requests wrk left queued when it stopped have all run.

    gunicorn still executes the requests that were sent (or queued in its
    listen backlog) when wrk exits; they must not count for the next run.
    """
    deadline = time.monotonic() + limit
    last = last_payment_id(connection)
    while time.monotonic() < deadline:
        time.sleep(quiet)
        now = last_payment_id(connection)
        if now == last:
            return
        last = now


def vacuum(connection: Any) -> None:
    for table in TABLES:
        connection.execute(f"VACUUM (ANALYZE) {table}")


def measure(
    args: argparse.Namespace, server: Gunicorn, database: Database, results: Results
) -> None:
    run_id = uuid.uuid4().hex[:8]
    measured = endpoints(args)
    replay_keys = {e.name: f"{run_id}-replay-{e.path.strip('/')}" for e in measured}
    prepare_replays(server, replay_keys)

    def load(endpoint: Endpoint, seconds: float, label: str) -> dict[str, Any]:
        """Run wrk on ``endpoint``; a new key per request unless it replays one."""
        fresh = f"{run_id}-{label}-{endpoint.path.strip('/')}"
        return wrk(
            server.url,
            endpoint,
            seconds=seconds,
            threads=args.threads,
            connections=args.connections,
            prefix=replay_keys[endpoint.name] if endpoint.mode == "fixed" else fresh,
        )

    with database.connect() as connection:
        if args.warmup > 0:
            print(f"warm-up: {args.warmup:g} s per endpoint", flush=True)
            for endpoint in measured:
                load(endpoint, args.warmup, "warm")
        for round_ in range(1, args.rounds + 1):
            shift = (round_ - 1) % len(measured)
            order = measured[shift:] + measured[:shift]
            for endpoint in order:
                settle(connection)
                vacuum(connection)
                before = last_payment_id(connection)
                outcome = load(endpoint, args.duration, f"r{round_}")
                written = last_payment_id(connection) - before
                errors = sum(
                    int(outcome[name])
                    for name in (
                        "connect_errors",
                        "read_errors",
                        "write_errors",
                        "status_errors",
                        "timeouts",
                    )
                )
                run = Run(
                    endpoint=endpoint.name,
                    round=round_,
                    requests_per_s=outcome["requests"] / (outcome["duration_us"] / 1e6),
                    p50_ms=outcome["p50_us"] / 1000,
                    p99_ms=outcome["p99_us"] / 1000,
                    requests=int(outcome["requests"]),
                    rows_written=written,
                    errors=errors,
                )
                results.runs.append(run)
                check(run, endpoint, args.connections, results)
                print(
                    f"round {round_}  {endpoint.name:<19} {run.requests_per_s:8.1f} req/s  "
                    f"p50 {run.p50_ms:6.2f} ms  p99 {run.p99_ms:6.2f} ms  "
                    f"({run.requests} requests, {run.rows_written} rows, {run.errors} errors)",
                    flush=True,
                )


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
    summary: dict[str, Any] = {"endpoints": {}, "targets": [], "facts": facts}
    print()
    print(
        f"{len(results.rounds())} rounds x {args.duration:g} s per endpoint, "
        f"wrk -t{args.threads} -c{args.connections}, gunicorn {args.workers} sync workers"
    )
    header = (
        f"{'endpoint':<20}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}"
        f"{'vs unprotected':>16}{'vs floor':>10}"
    )
    print(header)
    print("-" * len(header))
    floor_of = {
        PROTECTED.name: FLOOR,
        PROTECTED_REPLAY.name: FLOOR_REPLAY,
        SINGLE.name: FLOOR_SINGLE,
    }
    for endpoint in endpoints(args):
        runs = results.of(endpoint)
        rps = median([run.requests_per_s for run in runs])
        p50 = median([run.p50_ms for run in runs])
        p99 = median([run.p99_ms for run in runs])
        vs_unprotected = results.ratio(endpoint, UNPROTECTED)
        reference = floor_of.get(endpoint.name)
        vs_floor = results.ratio(endpoint, reference) if reference else None
        summary["endpoints"][endpoint.name] = {
            "requests_per_s": rps,
            "p50_ms": p50,
            "p99_ms": p99,
            "vs_unprotected": vs_unprotected,
            "vs_floor": vs_floor,
            "per_round_requests_per_s": [round(run.requests_per_s, 1) for run in runs],
        }
        floor_text = f"{vs_floor:9.2f}x" if vs_floor is not None else f"{'':>10}"
        print(
            f"{endpoint.name:<20}{rps:9.1f}{p50:9.2f}{p99:9.2f}{vs_unprotected:15.2f}x{floor_text}"
        )
    print()
    print("requests/s per round (rounds rotate the order):")
    for endpoint in endpoints(args):
        values = " ".join(f"{run.requests_per_s:8.1f}" for run in results.of(endpoint))
        print(f"  {endpoint.name:<20}{values}")
    print()
    for endpoint, reference, target in TARGETS:
        if endpoint not in endpoints(args) or reference not in endpoints(args):
            continue
        ratio = results.ratio(endpoint, reference)
        met = ratio >= target
        verdict = "met" if met else f"MISSED by {(target - ratio) / target:.0%}"
        print(f"target: {endpoint.name} >= {target:.2f}x {reference.name}: {ratio:.2f}x, {verdict}")
        summary["targets"].append(
            {
                "endpoint": endpoint.name,
                "reference": reference.name,
                "target": target,
                "ratio": ratio,
                "met": met,
            }
        )
    if results.problems:
        print("\nPROBLEMS:")
        for problem in results.problems:
            print(f"  {problem}")
    summary["problems"] = results.problems
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per endpoint run")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds per endpoint, once")
    parser.add_argument("--threads", type=int, default=2, help="wrk threads")
    parser.add_argument("--connections", type=int, default=8, help="wrk connections")
    parser.add_argument("--workers", type=int, default=2, help="gunicorn sync workers")
    parser.add_argument(
        "--single-transaction",
        action="store_true",
        help="also measure @idempotent(single_transaction=True) first executions",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--keep", action="store_true", help="keep the database")
    args = parser.parse_args(argv)
    if shutil.which("wrk") is None:
        print("wrk is not installed (Debian: apt-get install wrk)", file=sys.stderr)
        return 2

    facts = machine()
    started = time.monotonic()
    results = Results()
    with Database(postgres_url(), "idem_bench_http", keep=args.keep) as database:
        with database.connect() as connection:
            facts.update(server_facts(connection))
        migrate(database)
        facts["load_before"] = load_average()
        print(
            f"{facts['cpus']} x {facts['cpu']}, {facts['memory']}, Python {facts['python']}, "
            f"PostgreSQL {facts['server_version']} (shared_buffers {facts['shared_buffers']}, "
            f"synchronous_commit {facts['synchronous_commit']}, autovacuum "
            f"{facts['autovacuum']}), commit {facts['commit']}; load average "
            f"{facts['load_before']}",
            flush=True,
        )
        with Gunicorn(database, workers=args.workers) as server:
            measure(args, server, database, results)
            results.problems.extend(f"gunicorn log: {line}" for line in server.problems()[:10])
        facts["load_after"] = load_average()
    facts["elapsed_s"] = f"{time.monotonic() - started:.0f}"
    summary = report(results, args, facts)
    print(f"\nload average before {facts['load_before']}, after {facts['load_after']}")
    if args.json:
        summary["runs"] = [vars(run) for run in results.runs]
        summary["arguments"] = {k: str(v) for k, v in vars(args).items()}
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 1 if results.problems else 0


if __name__ == "__main__":
    sys.exit(main())
