#!/usr/bin/env python3
"""HTTP throughput and latency: unprotected, both @idempotent modes, and hand-written floors.

    .venv/bin/python benchmarks/http.py [--rounds 10] [--duration 5] [--only NAMES | --targets]
                                        [--single-transaction] [--json out.json]

1. creates a fresh PostgreSQL database (``idem_bench_http_<random>``) on the
   server given by ``IDEMPOTENCY_BENCH_POSTGRES_URL`` (default: the local
   server, user postgres) and migrates the benchmark project into it
   (benchmarks/benchproject, benchmarks/benchapp: nothing from the tests);
2. counts the statements one request of each endpoint sends (Django's test
   client in this process, under CaptureQueriesContext);
3. starts gunicorn on 127.0.0.1 (2 sync workers, no access log);
4. drives the endpoints with wrk (``-t2 -c8``, benchmarks/wrk/bench.lua), all
   but the first making the same business write (one INSERT into
   ``benchapp_payment``; see benchapp/views.py):

   * ``no write``: the unprotected view without its INSERT (no database): the
     framework's fixed cost;
   * ``unprotected``: the bare DRF view;
   * ``protected``: the same view under ``@idempotent`` (claim first, two
     commits), a new key per request (first executions);
   * ``protected replay``: one key and body, replayed on every request;
   * ``optimistic`` and ``optimistic replay``: the same under
     ``@idempotent(optimistic=True)`` (lookup, view, one conditional INSERT of
     the finished record, one commit);
   * ``floor`` and ``floor replay``: a minimal correct idempotency in raw SQL,
     claim first, two commits;
   * ``floor lookup-first`` and its replay: the same floor looking the key up
     before claiming (which order wins each case);
   * ``floor optimistic`` and its replay: the optimistic design by hand, its
     ceiling;
   * with ``--single-transaction`` also ``floor single``, the
     single-transaction design written by hand (the package's
     ``single_transaction`` mode was removed: it wrote what the default
     mode writes, and the optimistic mode beats it; docs/performance.md);

   interleaved in one run: ``--rounds`` rounds, each running every endpoint
   for ``--duration`` seconds, the order rotating from round to round (the
   defaults, 10 x 5 s x 12 endpoints, take about 14 minutes; ``--only`` picks
   endpoints by name; ``--targets`` runs the eight the release's throughput
   targets need: unprotected, floor, floor replay, floor optimistic,
   protected, protected replay, optimistic, optimistic replay, about 10
   minutes). Before each run the three tables are vacuumed and analysed
   (this server may run without autovacuum; in production autovacuum does
   it), outside the timing;
5. prints requests/s and the p50 and p99 latency of each endpoint (medians
   over the rounds, p99's lowest and highest round beside), the ratios
   against the unprotected endpoint, the floor and the endpoint's own
   hand-written design (medians of the per-round ratios, and their spread:
   interquartile range and lowest-highest round), the statements per
   request, the view's own cost, the order that wins, and the targets with
   this run's ratio, its spread, how many rounds met it and a verdict (on
   the median);
6. checks what it measured: no error or non-2xx answer, every first execution
   wrote one row, no replay (and no ``no write`` request) wrote any;
7. stops gunicorn and drops the database.

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
import os  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402
import uuid  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks.benchlib import (  # noqa: E402
    BENCH_SETTINGS,
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


NO_WRITE = Endpoint("no write", "/no-write", "none", False)
UNPROTECTED = Endpoint("unprotected", "/unprotected", "none", True)
PROTECTED = Endpoint("protected", "/protected", "unique", True)
PROTECTED_REPLAY = Endpoint("protected replay", "/protected", "fixed", False)
OPTIMISTIC = Endpoint("optimistic", "/protected-optimistic", "unique", True)
OPTIMISTIC_REPLAY = Endpoint("optimistic replay", "/protected-optimistic", "fixed", False)
FLOOR = Endpoint("floor", "/floor", "unique", True)
FLOOR_REPLAY = Endpoint("floor replay", "/floor", "fixed", False)
FLOOR_LOOKUP = Endpoint("floor lookup-first", "/floor-lookup-first", "unique", True)
FLOOR_LOOKUP_REPLAY = Endpoint("floor lookup-first replay", "/floor-lookup-first", "fixed", False)
FLOOR_OPTIMISTIC = Endpoint("floor optimistic", "/floor-optimistic", "unique", True)
FLOOR_OPTIMISTIC_REPLAY = Endpoint("floor optimistic replay", "/floor-optimistic", "fixed", False)
#: Only with --single-transaction: the hand-written single-transaction floor.
FLOOR_SINGLE = Endpoint("floor single", "/floor-single", "unique", True)
ENDPOINTS = (
    NO_WRITE,
    UNPROTECTED,
    PROTECTED,
    PROTECTED_REPLAY,
    OPTIMISTIC,
    OPTIMISTIC_REPLAY,
    FLOOR,
    FLOOR_REPLAY,
    FLOOR_LOOKUP,
    FLOOR_LOOKUP_REPLAY,
    FLOOR_OPTIMISTIC,
    FLOOR_OPTIMISTIC_REPLAY,
)
EVERY_ENDPOINT = (*ENDPOINTS, FLOOR_SINGLE)

#: The two-commit, claim-first floor of the same kind (first execution or replay):
#: the "vs floor" column.
FLOOR_OF = {
    **{e.name: FLOOR for e in EVERY_ENDPOINT if e.mode == "unique" and e is not FLOOR},
    **{e.name: FLOOR_REPLAY for e in EVERY_ENDPOINT if e.mode == "fixed" and e is not FLOOR_REPLAY},
}
#: Each package mode's own design written by hand: the "vs ceiling" column.
CEILING_OF = {
    PROTECTED.name: FLOOR,
    PROTECTED_REPLAY.name: FLOOR_REPLAY,
    OPTIMISTIC.name: FLOOR_OPTIMISTIC,
    OPTIMISTIC_REPLAY.name: FLOOR_OPTIMISTIC_REPLAY,
}

#: The endpoints the throughput targets need (``--targets``).
TARGET_ENDPOINTS = (
    UNPROTECTED,
    FLOOR,
    FLOOR_REPLAY,
    FLOOR_OPTIMISTIC,
    PROTECTED,
    PROTECTED_REPLAY,
    OPTIMISTIC,
    OPTIMISTIC_REPLAY,
)


@dataclass(frozen=True)
class Target:
    """The median of the per-round ratios of ``endpoint`` to ``reference`` against ``bound``."""

    what: str
    endpoint: Endpoint
    reference: Endpoint
    bound: float
    #: "rps": requests/s, at least ``bound``; "p99": p99 latency, at most ``bound``.
    figure: str = "rps"

    def met(self, ratio: float) -> bool:
        return ratio >= self.bound if self.figure == "rps" else ratio <= self.bound

    @property
    def wanted(self) -> str:
        return f">= {self.bound:.2f}x" if self.figure == "rps" else f"<= {self.bound:.2f}x"


#: The release's throughput targets: ratios in one interleaved run.
TARGETS = (
    Target("default first execution vs the two-commit floor", PROTECTED, FLOOR, 0.95),
    Target("default first execution p99 vs the floor's", PROTECTED, FLOOR, 1.00, "p99"),
    Target(
        "optimistic first execution vs the hand-written one-commit floor",
        OPTIMISTIC,
        FLOOR_OPTIMISTIC,
        0.95,
    ),
    Target("default replay vs the floor's replay", PROTECTED_REPLAY, FLOOR_REPLAY, 1.00),
    Target("optimistic replay vs the floor's replay", OPTIMISTIC_REPLAY, FLOOR_REPLAY, 1.00),
)


def endpoints(args: argparse.Namespace) -> tuple[Endpoint, ...]:
    chosen: tuple[Endpoint, ...] = EVERY_ENDPOINT if args.single_transaction else ENDPOINTS
    if args.targets:
        chosen = TARGET_ENDPOINTS
    elif args.only:
        wanted = {name.strip() for name in args.only.split(",")} | {UNPROTECTED.name}
        chosen = tuple(e for e in EVERY_ENDPOINT if e.name in wanted)
    return chosen


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

    def ratios(self, endpoint: Endpoint, reference: Endpoint, figure: str = "rps") -> list[float]:
        """Each round's ratio of req/s (or of p99 latency, ``figure="p99"``)."""

        def value(run: Run) -> float:
            return run.requests_per_s if figure == "rps" else run.p99_ms

        by_round = {run.round: value(run) for run in self.of(reference)}
        return [
            value(run) / by_round[run.round] for run in self.of(endpoint) if run.round in by_round
        ]

    def ratio(self, endpoint: Endpoint, reference: Endpoint) -> float | None:
        """Median over the rounds of this round's req/s ratio (None: one was not measured)."""
        ratios = self.ratios(endpoint, reference)
        return median(ratios) if ratios else None

    def spread(self, endpoint: Endpoint, reference: Endpoint, figure: str = "rps") -> Spread | None:
        ratios = self.ratios(endpoint, reference, figure)
        return Spread.of(ratios) if ratios else None


@dataclass(frozen=True)
class Spread:
    """The per-round ratios: their median, quartiles and extremes."""

    median: float
    q1: float
    q3: float
    low: float
    high: float
    rounds: int

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        if len(values) > 1:
            q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
        else:
            q1 = q3 = values[0]
        return cls(median(values), q1, q3, min(values), max(values), len(values))

    def text(self) -> str:
        return (
            f"{self.median:.2f}x [IQR {self.q1:.2f}-{self.q3:.2f}, "
            f"range {self.low:.2f}-{self.high:.2f}]"
        )

    def as_dict(self) -> dict[str, float]:
        return {
            "median": self.median,
            "q1": self.q1,
            "q3": self.q3,
            "min": self.low,
            "max": self.high,
            "rounds": self.rounds,
        }


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


def prepare_replays(server: Gunicorn, replays: list[Endpoint], keys: dict[str, str]) -> None:
    """One first execution per replayed key, then check that a retry is a replay."""
    for endpoint in replays:
        url = server.url + endpoint.path
        first = post(url, keys[endpoint.name])
        again = post(url, keys[endpoint.name])
        if first[0] != 201 or again[0] != 201 or again[1].get("Idempotent-Replayed") != "true":
            raise RuntimeError(f"{endpoint.name}: no replay: {first} then {again}")
        if first[2] != again[2]:
            raise RuntimeError(f"{endpoint.name}: replayed body differs: {first[2]!r} {again[2]!r}")


#: What Django logs for transaction control (Django >= 4.2): round trips, not statements.
TRANSACTION_CONTROL = ("BEGIN", "COMMIT", "ROLLBACK")


@dataclass
class Statements:
    """What one request of an endpoint sent, captured in this process."""

    sql: list[str]
    status: int

    @property
    def statements(self) -> list[str]:
        """The SQL statements, without BEGIN, COMMIT and ROLLBACK (as the targets count them)."""
        return [sql for sql in self.sql if sql.strip().upper() not in TRANSACTION_CONTROL]

    @property
    def count(self) -> int:
        return len(self.statements)

    @property
    def round_trips(self) -> int:
        """Every statement and transaction control sent (savepoints included)."""
        return len(self.sql)


def count_statements(database: Database, measured: tuple[Endpoint, ...]) -> dict[str, Statements]:
    """One request per endpoint through Django's test client, under CaptureQueriesContext.

    Counted, not assumed: "statements per optimistic first execution" in the
    targets is this count minus the unprotected view's. Replays are counted
    on the retry of a key executed just before. Django logs BEGIN and
    COMMIT too: they count as round trips, not as statements.
    """
    os.environ["DATABASE_URL"] = database.url
    os.environ["DJANGO_SETTINGS_MODULE"] = BENCH_SETTINGS
    import django

    django.setup()
    from django.db import connection, connections
    from django.test import Client
    from django.test.utils import CaptureQueriesContext

    client = Client(SERVER_NAME="localhost")
    run_id = uuid.uuid4().hex[:8]
    counted: dict[str, Statements] = {}

    def send(path: str, key: str | None) -> Any:
        headers = {} if key is None else {"Idempotency-Key": key}
        return client.post(path, BODY, content_type="application/json", headers=headers)

    try:
        for endpoint in measured:
            label = f"{run_id}-count-{endpoint.path.strip('/')}"
            if endpoint.mode == "fixed":
                keys: tuple[str | None, str | None] = (label, label)
            elif endpoint.mode == "unique":
                keys = (f"{label}-warm", f"{label}-counted")
            else:
                keys = (None, None)
            send(endpoint.path, keys[0])  # warm: the first request of a path loads code
            with CaptureQueriesContext(connection) as captured:
                response = send(endpoint.path, keys[1])
            replayed = response.headers.get("Idempotent-Replayed") == "true"
            if response.status_code != 201 or replayed != (endpoint.mode == "fixed"):
                raise RuntimeError(
                    f"{endpoint.name}: counting request answered {response.status_code}, "
                    f"replayed={replayed}: {response.content!r}"
                )
            sql = [str(query["sql"]) for query in captured.captured_queries]
            counted[endpoint.name] = Statements(sql=sql, status=response.status_code)
    finally:
        connections.close_all()
    return counted


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
    prepare_replays(server, [e for e in measured if e.mode == "fixed"], replay_keys)

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
                    f"round {round_}  {endpoint.name:<26} {run.requests_per_s:8.1f} req/s  "
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


def ratio_text(ratio: float | None, width: int) -> str:
    return f"{ratio:{width - 1}.2f}x" if ratio is not None else f"{'':>{width}}"


def report(
    results: Results,
    args: argparse.Namespace,
    facts: dict[str, str],
    statements: dict[str, Statements],
) -> dict[str, Any]:
    measured = endpoints(args)
    summary: dict[str, Any] = {"endpoints": {}, "targets": [], "facts": facts}
    print()
    print(
        f"{len(results.rounds())} rounds x {args.duration:g} s per endpoint, "
        f"wrk -t{args.threads} -c{args.connections}, gunicorn {args.workers} sync workers"
    )
    header = (
        f"{'endpoint':<27}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'p99 range':>15}"
        f"{'vs unprotected':>16}{'vs floor':>10}{'vs ceiling':>12}{'statements':>12}"
        f"{'round trips':>13}"
    )
    print(header)
    print("-" * len(header))
    for endpoint in measured:
        runs = results.of(endpoint)
        rps = median([run.requests_per_s for run in runs])
        p50 = median([run.p50_ms for run in runs])
        p99s = [run.p99_ms for run in runs]
        p99 = median(p99s)
        floor = FLOOR_OF.get(endpoint.name)
        ceiling = CEILING_OF.get(endpoint.name)
        spreads = {
            "vs_unprotected": results.spread(endpoint, UNPROTECTED),
            "vs_floor": results.spread(endpoint, floor) if floor else None,
            "vs_ceiling": results.spread(endpoint, ceiling) if ceiling else None,
        }
        count = statements[endpoint.name].count
        round_trips = statements[endpoint.name].round_trips
        summary["endpoints"][endpoint.name] = {
            "requests_per_s": rps,
            "p50_ms": p50,
            "p99_ms": p99,
            "p99_ms_min": min(p99s),
            "p99_ms_max": max(p99s),
            **{name: found.median if found else None for name, found in spreads.items()},
            **{
                f"{name}_spread": found.as_dict() if found else None
                for name, found in spreads.items()
            },
            "ceiling": ceiling.name if ceiling else None,
            "statements": count,
            "round_trips": round_trips,
            "statements_sql": statements[endpoint.name].sql,
            "per_round_requests_per_s": [round(run.requests_per_s, 1) for run in runs],
            "per_round_p99_ms": [round(run.p99_ms, 2) for run in runs],
        }
        medians = [found.median if found else None for found in spreads.values()]
        print(
            f"{endpoint.name:<27}{rps:9.1f}{p50:9.2f}{p99:9.2f}"
            f"{f'{min(p99s):.1f}-{max(p99s):.1f}':>15}"
            f"{ratio_text(medians[0], 16)}{ratio_text(medians[1], 10)}"
            f"{ratio_text(medians[2], 12)}{count:12d}{round_trips:13d}"
        )
    print(
        "  ratios: medians of the per-round req/s ratios; p99 range: the lowest and highest "
        "round's;\n  vs floor: the two-commit claim-first floor of the same kind (first "
        "execution or replay);\n  vs ceiling: the same design written by hand (optimistic: "
        "floor optimistic; protected: floor);\n  statements: one request under "
        "CaptureQueriesContext, BEGIN and COMMIT not counted; round trips: with them."
    )
    print()
    print("the ratios' spread over the rounds: median [interquartile range, lowest-highest]:")
    for endpoint in measured:
        texts = []
        for label, reference in (
            ("unprotected", UNPROTECTED),
            ("floor", FLOOR_OF.get(endpoint.name)),
            ("ceiling", CEILING_OF.get(endpoint.name)),
        ):
            found = results.spread(endpoint, reference) if reference else None
            if found is not None and reference is not endpoint:
                texts.append(f"vs {label} {found.text()}")
        if texts:
            print(f"  {endpoint.name:<27}" + "; ".join(texts))
    print()
    print("requests/s per round (rounds rotate the order):")
    for endpoint in measured:
        values = " ".join(f"{run.requests_per_s:8.1f}" for run in results.of(endpoint))
        print(f"  {endpoint.name:<27}{values}")
    summary["view_cost"] = report_view_cost(results, measured)
    summary["order"] = report_order(results, measured)
    summary["targets"] = report_targets(results, measured)
    if results.problems:
        print("\nPROBLEMS:")
        for problem in results.problems:
            print(f"  {problem}")
    summary["problems"] = results.problems
    return summary


def report_view_cost(results: Results, measured: tuple[Endpoint, ...]) -> dict[str, float]:
    """The framework's fixed cost against the business write's."""
    if NO_WRITE not in measured:
        return {}
    bare = median([run.requests_per_s for run in results.of(NO_WRITE)])
    with_write = median([run.requests_per_s for run in results.of(UNPROTECTED)])
    share = 1 - (results.ratio(UNPROTECTED, NO_WRITE) or 0.0)
    added_ms = 1000 / with_write - 1000 / bare
    print()
    print("the benchmark view's own cost:")
    for endpoint, what in (
        (NO_WRITE, "the DRF view, no database"),
        (UNPROTECTED, "the same and its INSERT (autocommit)"),
    ):
        runs = results.of(endpoint)
        print(
            f"  {endpoint.name:<13}{what:<38}"
            f"{median([run.requests_per_s for run in runs]):9.1f} req/s  "
            f"p50 {median([run.p50_ms for run in runs]):6.2f} ms  "
            f"p99 {median([run.p99_ms for run in runs]):6.2f} ms"
        )
    print(
        f"  the business INSERT and its commit: {share:.0%} of an unprotected request's cost\n"
        f"  (1 - the req/s ratio), {added_ms:.2f} ms more per request (1000 / req/s; wrk,\n"
        f"  gunicorn and PostgreSQL share this machine); the other {1 - share:.0%} is Django,\n"
        "  DRF, gunicorn and HTTP, a fixed cost inside every ratio against unprotected"
    )
    return {"write_share_of_unprotected": share, "write_ms_per_request": added_ms}


def report_order(results: Results, measured: tuple[Endpoint, ...]) -> dict[str, float]:
    """Claim first or look the key up first, in the hand-written floor."""
    pairs = (
        ("first executions", FLOOR_LOOKUP, FLOOR),
        ("replays", FLOOR_LOOKUP_REPLAY, FLOOR_REPLAY),
    )
    found: dict[str, float] = {}
    lines = []
    for what, lookup_first, claim_first in pairs:
        if lookup_first not in measured or claim_first not in measured:
            continue
        ratio = results.ratio(lookup_first, claim_first)
        assert ratio is not None
        found[what] = ratio
        winner = "lookup first" if ratio > 1 else "claim first"
        lines.append(f"  {what:<17} lookup first / claim first = {ratio:.2f}x  -> {winner} wins")
    if lines:
        print()
        print("claim first or look the key up first (the two-commit floor):")
        print("\n".join(lines))
    return found


def report_targets(results: Results, measured: tuple[Endpoint, ...]) -> list[dict[str, Any]]:
    """The release's throughput targets with this run's ratios, their spread and a verdict."""
    rows: list[dict[str, Any]] = []
    for target in TARGETS:
        if target.endpoint not in measured or target.reference not in measured:
            continue
        ratios = results.ratios(target.endpoint, target.reference, target.figure)
        found = Spread.of(ratios)
        rows.append(
            {
                "what": target.what,
                "endpoint": target.endpoint.name,
                "reference": target.reference.name,
                "figure": target.figure,
                "ratio": found.median,
                "spread": found.as_dict(),
                "target": target.wanted,
                "rounds_meeting": sum(1 for ratio in ratios if target.met(ratio)),
                "met": target.met(found.median),
            }
        )
    if rows:
        print()
        print(
            "targets, this run (ratios: medians of the per-round ratios of req/s, or of p99 "
            "latency; the verdict is the median's):"
        )
        print()
        print("| target | median | interquartile range | lowest-highest | rounds met | wanted | |")
        print("|---|---:|---:|---:|---:|---:|---|")
        for row in rows:
            spread = row["spread"]
            print(
                f"| {row['what']} | {row['ratio']:.2f}x | {spread['q1']:.2f}-{spread['q3']:.2f} "
                f"| {spread['min']:.2f}-{spread['max']:.2f} | {row['rounds_meeting']}/"
                f"{spread['rounds']} | {row['target']} | {'met' if row['met'] else 'NOT MET'} |"
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per endpoint run")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds per endpoint, once")
    parser.add_argument("--threads", type=int, default=2, help="wrk threads")
    parser.add_argument("--connections", type=int, default=8, help="wrk connections")
    parser.add_argument("--workers", type=int, default=2, help="gunicorn sync workers")
    parser.add_argument(
        "--only",
        help="comma-separated endpoint names to measure (unprotected is always added), e.g. "
        '"optimistic,optimistic replay,floor"',
    )
    parser.add_argument(
        "--targets",
        action="store_true",
        help="measure only the endpoints the release's throughput targets need: "
        + ", ".join(endpoint.name for endpoint in TARGET_ENDPOINTS),
    )
    parser.add_argument(
        "--single-transaction",
        action="store_true",
        help="also measure the hand-written single-transaction floor",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--keep", action="store_true", help="keep the database")
    args = parser.parse_args(argv)
    if args.only and args.targets:
        parser.error("--only and --targets: choose one")
    if args.only:
        known = {endpoint.name for endpoint in EVERY_ENDPOINT}
        unknown = {name.strip() for name in args.only.split(",")} - known
        if unknown:
            parser.error(f"--only: unknown {sorted(unknown)}; known: {sorted(known)}")
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
        statements = count_statements(database, endpoints(args))
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
    summary = report(results, args, facts, statements)
    print(
        f"\nload average before {facts['load_before']}, after {facts['load_after']}; "
        f"wall time {facts['elapsed_s']} s"
    )
    if args.json:
        summary["runs"] = [vars(run) for run in results.runs]
        summary["arguments"] = {k: str(v) for k, v in vars(args).items()}
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 1 if results.problems else 0


if __name__ == "__main__":
    sys.exit(main())
