#!/usr/bin/env python3
"""What metrics and spans cost per request: four telemetry configurations against each other.

    .venv/bin/python benchmarks/telemetry_cost.py [--rounds 3] [--duration 8]
                                                  [--batches 15] [--requests 200]
                                                  [--skip http|in-process] [--json out.json]

The configurations (benchmarks/benchproject/telemetry.py, picked by
``IDEMPOTENCY_BENCH_TELEMETRY``):

* ``off``: ``METRICS = ()``, ``TRACING = False``: the baseline;
* ``api only``: the defaults (``METRICS = ("opentelemetry",)``, ``TRACING =
  True``) with the OpenTelemetry API and no SDK: what a project that
  installed the package and nothing else gets;
* ``opentelemetry sdk``: the defaults with an SDK in each process: a
  MeterProvider with a PeriodicExportingMetricReader (every 10 s) and a
  TracerProvider sampling everything into a BatchSpanProcessor, both to
  exporters that count and drop (OTLP without a collector);
* ``prometheus``: ``METRICS = ("prometheus",)``, ``TRACING = False``, in
  prometheus_client's multiprocess mode (a fresh ``PROMETHEUS_MULTIPROC_DIR``).

1. creates a fresh PostgreSQL database (``idem_bench_telemetry_<random>``,
   ``IDEMPOTENCY_BENCH_POSTGRES_URL`` as in benchmarks/http.py) and migrates
   the benchmark project into it;
2. in-process: one interpreter per configuration (an SDK, once installed,
   cannot be taken out), each sending requests to ``/protected`` through
   Django's test client: ``--batches`` batches of ``--requests`` first
   executions and as many replays, the configurations and endpoints taking
   turns, the order rotating from batch to batch (a machine's load drifts);
   the CPU time (``time.process_time``: the interpreter's, its exporting
   threads included, PostgreSQL's not) and the wall time per request. The
   steadier figure on a small machine: no HTTP, no gunicorn, no wrk
   competing for the CPUs;
3. over HTTP: one gunicorn per configuration (2 sync workers, ``-c
   benchmarks/benchproject/gunicorn_telemetry.py``: the SDK installed after
   the fork, ``mark_process_dead`` at a worker's exit), all four started
   first; ``protected`` (a new key per request) and ``protected replay``
   (one key) driven by wrk (``-t2 -c8``) for ``--duration`` seconds each,
   every configuration in every round, the order rotating from round to
   round;
4. prints req/s and p50/p99 per endpoint and configuration (medians over
   the rounds) with each one's ratio to ``off`` (medians of the per-round
   ratios), and the in-process CPU microseconds per request with the
   difference to ``off`` (the median of the per-batch differences); also
   the best of each (the highest req/s, the lowest CPU time: on a shared
   machine, the run least disturbed by others) against ``off``'s best;
5. checks what it measured: no error or non-2xx answer, one payment row
   per first execution and none per replay, and that each configuration is
   what it claims and recorded everything: every worker reports its sinks
   and providers (``/telemetry``); the SDK's exporters saw as many
   ``executed`` and ``replayed`` counts, durations and ``idempotency.view``
   spans as there were first executions and replays; the Prometheus scrape
   (``/metrics``, every worker's files) counts the same;
6. stops the servers and drops the database.

Needs wrk. Absolute figures vary from run to run; compare the ratios.
"""

from __future__ import annotations

import sys
from pathlib import Path

# As in benchmarks/http.py: this directory first on sys.path would make
# benchmarks/http.py shadow the standard library's http package.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402
import uuid  # noqa: E402
from collections import defaultdict  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks.benchlib import (  # noqa: E402
    Database,
    Gunicorn,
    django_env,
    load_average,
    machine,
    median,
    migrate,
    postgres_url,
    server_facts,
)
from benchmarks.benchproject.telemetry import ENV as TELEMETRY_ENV  # noqa: E402
from benchmarks.http import (  # noqa: E402
    BODY,
    PROTECTED,
    PROTECTED_REPLAY,
    Endpoint,
    Results,
    Run,
    check,
    last_payment_id,
    prepare_replays,
    settle,
    vacuum,
    wrk,
)

WRK_ERRORS = ("connect_errors", "read_errors", "write_errors", "status_errors", "timeouts")
GUNICORN_CONFIG = "python:benchmarks.benchproject.gunicorn_telemetry"
ENDPOINTS = (PROTECTED, PROTECTED_REPLAY)


@dataclass(frozen=True)
class Configuration:
    name: str
    #: The value of IDEMPOTENCY_BENCH_TELEMETRY.
    slug: str


OFF = Configuration("off", "off")
API_ONLY = Configuration("api only", "api-only")
SDK = Configuration("opentelemetry sdk", "sdk")
PROMETHEUS = Configuration("prometheus", "prometheus")
CONFIGURATIONS = (OFF, API_ONLY, SDK, PROMETHEUS)


def rotated(items: tuple[Any, ...], round_: int) -> tuple[Any, ...]:
    shift = (round_ - 1) % len(items)
    return items[shift:] + items[:shift]


def configuration_env(configuration: Configuration, scratch: Path) -> dict[str, str]:
    """The variables a process of ``configuration`` runs with (a fresh multiprocess dir)."""
    env = {TELEMETRY_ENV: configuration.slug}
    if configuration is PROMETHEUS:
        directory = Path(tempfile.mkdtemp(prefix="prometheus-", dir=scratch))
        env["PROMETHEUS_MULTIPROC_DIR"] = str(directory)
    return env


# -- what each configuration recorded ---------------------------------------------------


def scrape(text: str) -> dict[str, float]:
    """Request counts by outcome and the duration histogram's count, from Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "idempotency_requests_total":
                found[sample.labels["outcome"]] += sample.value
            elif sample.name == "idempotency_protection_duration_seconds_count":
                found["durations"] += sample.value
    return dict(found)


@dataclass
class Expected:
    """What went through one process (or server): the counts its telemetry must show."""

    executed: int = 0
    #: Replays counted by the client (wrk cannot count those cut off at its end).
    replayed: int = 0
    #: How many more replays may have run uncounted.
    replay_slack: int = 0


def check_recorded(
    configuration: Configuration,
    reports: list[dict[str, Any]],
    scraped: dict[str, float] | None,
    expected: Expected,
    where: str,
) -> tuple[str, list[str]]:
    """What ``configuration`` recorded, in one line, and what is wrong with it."""
    problems: list[str] = []
    for report in reports:
        sinks = report["sinks"]
        tracing = report["tracing_setting"]
        providers = (report.get("meter_provider", ""), report.get("tracer_provider", ""))
        if configuration is OFF:
            wanted = sinks == [] and not tracing
        elif configuration is API_ONLY:
            wanted = (
                sinks == ["OpenTelemetrySink()"]
                and tracing
                and providers == ("_ProxyMeterProvider", "ProxyTracerProvider")
            )
        elif configuration is SDK:
            wanted = (
                sinks == ["OpenTelemetrySink()"]
                and tracing
                and providers == ("MeterProvider", "TracerProvider")
            )
        else:
            wanted = sinks == ["PrometheusSink()"] and not tracing
        if not wanted:
            problems.append(
                f"{where}: process {report['pid']} is not {configuration.name}: {report}"
            )

    def counted(executed: float, replayed: float, durations: float, what: str) -> None:
        low, high = expected.replayed, expected.replayed + expected.replay_slack
        if executed != expected.executed:
            problems.append(f"{where}: {what}: {executed:g} executed, {expected.executed} ran")
        if not low <= replayed <= high:
            problems.append(f"{where}: {what}: {replayed:g} replayed, {low} to {high} sent")
        if durations != executed + replayed:
            problems.append(f"{where}: {what}: {durations:g} durations for {executed + replayed:g}")

    if configuration is SDK:
        requests: dict[str, float] = defaultdict(float)
        spans: dict[str, int] = defaultdict(int)
        durations = 0.0
        for report in reports:
            for outcome, value in report.get("requests", {}).items():
                requests[outcome] += value
            for name, value in report.get("spans", {}).items():
                spans[name] += value
            durations += report.get("durations", 0)
        executed, replayed = requests["executed"], requests["replayed"]
        counted(executed, replayed, durations, "SDK metrics")
        if spans["idempotency.view"] != executed:
            problems.append(f"{where}: {spans['idempotency.view']} view spans, {executed:g} views")
        if spans["idempotency.replay"] != replayed:
            problems.append(f"{where}: {spans['idempotency.replay']} replay spans, {replayed:g}")
        span_text = ", ".join(f"{name.split('.', 1)[1]} {n}" for name, n in sorted(spans.items()))
        summary = (
            f"SDK export: executed {executed:g}, replayed {replayed:g}, durations "
            f"{durations:g}; spans: {span_text}"
        )
    elif configuration is PROMETHEUS:
        assert scraped is not None
        executed, replayed = scraped.get("executed", 0.0), scraped.get("replayed", 0.0)
        counted(executed, replayed, scraped.get("durations", 0.0), "Prometheus scrape")
        summary = (
            f"/metrics: executed {executed:g}, replayed {replayed:g}, durations "
            f"{scraped.get('durations', 0.0):g}"
        )
    elif configuration is API_ONLY:
        summary = "nothing to record (no SDK): sinks and tracer are the API's proxies"
    else:
        summary = "no sink, no tracing"
    return (
        f"{summary} (expected: executed {expected.executed}, replayed {expected.replayed}"
        f"{f' + up to {expected.replay_slack}' if expected.replay_slack else ''})",
        problems,
    )


# -- in-process: Django's test client, one interpreter per configuration -----------------


def in_process_child() -> int:
    """The child: answers "<endpoint> <n>" with the time of n requests, "report", "quit".

    One line in, one line out (``IN-PROCESS {json}``) on stdin and stdout.
    """
    import django

    django.setup()
    from benchmarks.benchproject import telemetry

    if telemetry.configuration() == "sdk":
        telemetry.configure_sdk()
    from django.db import connections
    from django.test import Client

    client = Client(SERVER_NAME="localhost")
    run_id = uuid.uuid4().hex[:8]
    replay_key = f"{run_id}-replay"
    expected = Expected()
    sent = 0

    def last_id() -> int:
        with connections["default"].cursor() as cursor:
            cursor.execute("SELECT coalesce(max(id), 0) FROM benchapp_payment")
            return int(cursor.fetchone()[0])

    def send(key: str) -> Any:
        return client.post(
            "/protected", BODY, content_type="application/json", headers={"Idempotency-Key": key}
        )

    def answer(found: dict[str, Any]) -> None:
        print("IN-PROCESS " + json.dumps(found), flush=True)

    def batch(endpoint: Endpoint, requests: int) -> dict[str, Any]:
        nonlocal sent
        seen: dict[int, int] = defaultdict(int)
        keys = [
            replay_key if endpoint is PROTECTED_REPLAY else f"{run_id}-{sent + n}"
            for n in range(requests)
        ]
        sent += requests
        before = last_id()
        cpu, wall = time.process_time(), time.perf_counter()
        for key in keys:
            response = send(key)
            replayed = response.headers.get("Idempotent-Replayed") == "true"
            seen[response.status_code if replayed == (endpoint is PROTECTED_REPLAY) else -1] += 1
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        written = last_id() - before
        if endpoint is PROTECTED_REPLAY:
            expected.replayed += requests
        else:
            expected.executed += requests
        return {
            "cpu_us": cpu / requests * 1e6,
            "wall_us": wall / requests * 1e6,
            "rows_written": written,
            "statuses": seen,
        }

    send(replay_key)
    expected.executed += 1
    answer({"ready": True})
    for line in sys.stdin:
        command = line.split()
        if command[0] == "report":
            scraped = None
            if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
                scraped = scrape(client.get("/metrics").content.decode())
            answer({"report": telemetry.report(), "scraped": scraped, "expected": vars(expected)})
        elif command[0] == "quit":
            break
        else:
            endpoint = PROTECTED_REPLAY if command[0] == "replay" else PROTECTED
            answer(batch(endpoint, int(command[1])))
    connections.close_all()
    return 0


class Child:
    """One configuration's interpreter, driven line by line."""

    def __init__(self, configuration: Configuration, database: Database, scratch: Path) -> None:
        self.configuration = configuration
        # Read and closed by close(), once the child has stopped.
        self.stderr = tempfile.TemporaryFile(mode="w+", dir=scratch)  # noqa: SIM115
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--in-process-child"],
            env={**django_env(database), **configuration_env(configuration, scratch)},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
        )
        self.ask(None)

    def ask(self, command: str | None) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        if command is not None:
            self.process.stdin.write(command + "\n")
            self.process.stdin.flush()
        for line in self.process.stdout:
            if line.startswith("IN-PROCESS "):
                return dict(json.loads(line[len("IN-PROCESS ") :]))
        self.stderr.seek(0)
        raise RuntimeError(
            f"in-process {self.configuration.name} stopped:\n{self.stderr.read()[-3000:]}"
        )

    def close(self) -> str:
        """Stop it; what it wrote to stderr."""
        with contextlib.suppress(OSError):
            assert self.process.stdin is not None
            self.process.stdin.write("quit\n")
            self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.stderr.seek(0)
        text = self.stderr.read()
        self.stderr.close()
        return text


def close_child(child: Child, problems: list[str]) -> None:
    problems.extend(
        f"in-process, {child.configuration.name}: stderr: {line}"
        for line in child.close().splitlines()[-10:]
    )


@dataclass
class Timing:
    configuration: str
    endpoint: str
    round: int
    cpu_us: float
    wall_us: float


def in_process(
    args: argparse.Namespace, database: Database, scratch: Path, problems: list[str]
) -> tuple[list[Timing], dict[str, str]]:
    """``--batches`` batches per configuration and endpoint, the order rotating each time."""
    timings: list[Timing] = []
    recorded: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        children = []
        for configuration in CONFIGURATIONS:
            child = Child(configuration, database, scratch)
            stack.callback(close_child, child, problems)
            children.append(child)
        warm = max(50, args.requests // 5)  # the first requests load code and fill caches
        for child in children:
            for endpoint in ENDPOINTS:
                child.ask(f"{'replay' if endpoint is PROTECTED_REPLAY else 'protected'} {warm}")
        for batch in range(1, args.batches + 1):
            for child in rotated(tuple(children), batch):
                for endpoint in rotated(ENDPOINTS, batch):
                    verb = "replay" if endpoint is PROTECTED_REPLAY else "protected"
                    found = child.ask(f"{verb} {args.requests}")
                    where = f"in-process batch {batch}, {child.configuration.name}, {endpoint.name}"
                    if found["statuses"] != {"201": args.requests}:
                        problems.append(f"{where}: answers {found['statuses']}")
                    rows = args.requests if endpoint is PROTECTED else 0
                    if found["rows_written"] != rows:
                        problems.append(f"{where}: {found['rows_written']} rows, not {rows}")
                    timings.append(
                        Timing(
                            child.configuration.name,
                            endpoint.name,
                            batch,
                            found["cpu_us"],
                            found["wall_us"],
                        )
                    )
            print(
                f"in-process batch {batch}: "
                + "  ".join(
                    f"{t.configuration} {t.endpoint} {t.cpu_us:.0f} us"
                    for t in timings
                    if t.round == batch
                ),
                flush=True,
            )
        for child in children:
            found = child.ask("report")
            summary, wrong = check_recorded(
                child.configuration,
                [found["report"]],
                found["scraped"],
                Expected(**found["expected"]),
                f"in-process, {child.configuration.name}",
            )
            problems.extend(wrong)
            recorded[child.configuration.name] = summary
    return timings, recorded


# -- over HTTP: gunicorn and wrk ---------------------------------------------------------


@dataclass
class Served:
    configuration: Configuration
    server: Gunicorn
    replay_key: str
    expected: Expected = field(default_factory=Expected)


@dataclass
class HttpRun:
    configuration: str
    run: Run


def worker_reports(server: Gunicorn, workers: int, tries: int = 200) -> list[dict[str, Any]]:
    """``/telemetry`` of every worker (a new connection each time, until all have answered)."""
    reports: dict[int, dict[str, Any]] = {}
    for _ in range(tries):
        with urllib.request.urlopen(server.url + "/telemetry", timeout=30) as response:
            report = json.loads(response.read())
        reports[report["pid"]] = report
        if len(reports) >= workers:
            break
    return list(reports.values())


def measure_http(
    args: argparse.Namespace,
    servers: list[Served],
    database: Database,
    results: Results,
    runs: list[HttpRun],
) -> None:
    run_id = uuid.uuid4().hex[:8]
    with database.connect() as connection:

        def load(served: Served, endpoint: Endpoint, seconds: float, label: str) -> Run:
            settle(connection)
            vacuum(connection)
            before = last_payment_id(connection)
            outcome = wrk(
                served.server.url,
                endpoint,
                seconds=seconds,
                threads=args.threads,
                connections=args.connections,
                prefix=(
                    served.replay_key
                    if endpoint is PROTECTED_REPLAY
                    else f"{run_id}-{served.configuration.slug}-{label}"
                ),
            )
            settle(connection)
            written = last_payment_id(connection) - before
            served.expected.executed += written
            if endpoint is PROTECTED_REPLAY:
                served.expected.replayed += int(outcome["requests"])
                served.expected.replay_slack += args.connections
            errors = sum(int(outcome[name]) for name in WRK_ERRORS)
            return Run(
                endpoint=endpoint.name,
                round=0,
                requests_per_s=outcome["requests"] / (outcome["duration_us"] / 1e6),
                p50_ms=outcome["p50_us"] / 1000,
                p99_ms=outcome["p99_us"] / 1000,
                requests=int(outcome["requests"]),
                rows_written=written,
                errors=errors,
            )

        for served in servers:
            before = last_payment_id(connection)
            prepare_replays(
                served.server, [PROTECTED_REPLAY], {PROTECTED_REPLAY.name: served.replay_key}
            )
            served.expected.executed += last_payment_id(connection) - before
            served.expected.replayed += 1
            if args.warmup > 0:
                for endpoint in ENDPOINTS:
                    load(served, endpoint, args.warmup, "warm")
        print(f"warm-up: {args.warmup:g} s per endpoint and configuration", flush=True)
        for round_ in range(1, args.rounds + 1):
            for served in rotated(tuple(servers), round_):
                for endpoint in rotated(ENDPOINTS, round_):
                    run = load(served, endpoint, args.duration, f"r{round_}")
                    run.round = round_
                    runs.append(HttpRun(served.configuration.name, run))
                    local = Results()
                    check(run, endpoint, args.connections, local)
                    results.problems.extend(
                        f"{served.configuration.name}: {problem}" for problem in local.problems
                    )
                    print(
                        f"round {round_}  {served.configuration.name:<18}{endpoint.name:<18}"
                        f"{run.requests_per_s:8.1f} req/s  p50 {run.p50_ms:6.2f} ms  "
                        f"p99 {run.p99_ms:6.2f} ms  ({run.requests} requests, "
                        f"{run.rows_written} rows, {run.errors} errors)",
                        flush=True,
                    )


def http_recorded(
    args: argparse.Namespace, servers: list[Served], problems: list[str]
) -> dict[str, str]:
    recorded: dict[str, str] = {}
    for served in servers:
        where = f"HTTP, {served.configuration.name}"
        reports = worker_reports(served.server, args.workers)
        if len(reports) < args.workers:
            problems.append(f"{where}: only {len(reports)} of {args.workers} workers answered")
        scraped = None
        if served.configuration is PROMETHEUS:
            with urllib.request.urlopen(served.server.url + "/metrics", timeout=30) as response:
                scraped = scrape(response.read().decode())
        summary, wrong = check_recorded(
            served.configuration, reports, scraped, served.expected, where
        )
        problems.extend(wrong)
        recorded[served.configuration.name] = summary
    return recorded


# -- the report --------------------------------------------------------------------------


def per_round_ratio(values: dict[tuple[str, int], float], name: str, reference: str) -> float:
    rounds = sorted(round_ for (configuration, round_) in values if configuration == name)
    return median(
        [values[(name, r)] / values[(reference, r)] for r in rounds if (reference, r) in values]
    )


def report_http(args: argparse.Namespace, runs: list[HttpRun]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    print()
    print(
        f"over HTTP: {args.rounds} rounds x {args.duration:g} s per endpoint and configuration, "
        f"wrk -t{args.threads} -c{args.connections}, gunicorn {args.workers} sync workers"
    )
    header = (
        f"{'endpoint':<18}{'configuration':<19}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}"
        f"{'req/s vs off':>14}{'p50 vs off':>12}{'best req/s':>12}{'best vs off':>13}"
    )
    print(header)
    print("-" * len(header))
    for endpoint in ENDPOINTS:
        mine = [entry for entry in runs if entry.run.endpoint == endpoint.name]
        rps = {(e.configuration, e.run.round): e.run.requests_per_s for e in mine}
        p50 = {(e.configuration, e.run.round): e.run.p50_ms for e in mine}
        best_off = max(e.run.requests_per_s for e in mine if e.configuration == OFF.name)
        for configuration in CONFIGURATIONS:
            own = [e.run for e in mine if e.configuration == configuration.name]
            figures: dict[str, Any] = {
                "requests_per_s": median([run.requests_per_s for run in own]),
                "p50_ms": median([run.p50_ms for run in own]),
                "p99_ms": median([run.p99_ms for run in own]),
                "requests_per_s_vs_off": per_round_ratio(rps, configuration.name, OFF.name),
                "p50_vs_off": per_round_ratio(p50, configuration.name, OFF.name),
                "best_requests_per_s": max(run.requests_per_s for run in own),
                "per_round_requests_per_s": [round(run.requests_per_s, 1) for run in own],
            }
            summary.setdefault(endpoint.name, {})[configuration.name] = figures
            print(
                f"{endpoint.name:<18}{configuration.name:<19}{figures['requests_per_s']:9.1f}"
                f"{figures['p50_ms']:9.2f}{figures['p99_ms']:9.2f}"
                f"{figures['requests_per_s_vs_off']:13.3f}x{figures['p50_vs_off']:11.3f}x"
                f"{figures['best_requests_per_s']:12.1f}"
                f"{figures['best_requests_per_s'] / best_off:12.3f}x"
            )
    print(
        "  vs off: medians of the per-round ratios (req/s: below 1 is slower; p50: above 1);\n"
        "  best: the round least disturbed (the highest req/s), against off's best"
    )
    print()
    print("requests/s per round (rounds rotate the order):")
    for endpoint in ENDPOINTS:
        for configuration in CONFIGURATIONS:
            values = summary[endpoint.name][configuration.name]["per_round_requests_per_s"]
            print(
                f"  {endpoint.name:<18}{configuration.name:<19}"
                + " ".join(f"{value:8.1f}" for value in values)
            )
    return summary


def report_in_process(args: argparse.Namespace, timings: list[Timing]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    print()
    print(
        f"in-process (Django's test client, {args.batches} batches of {args.requests} requests "
        "per endpoint and configuration, interleaved; medians over the batches):"
    )
    header = (
        f"{'endpoint':<18}{'configuration':<19}{'CPU us':>9}{'wall us':>9}"
        f"{'CPU +us vs off':>16}{'CPU vs off':>12}{'wall vs off':>13}"
        f"{'best CPU us':>13}{'best +us':>10}"
    )
    print(header)
    print("-" * len(header))
    for endpoint in ENDPOINTS:
        mine = [t for t in timings if t.endpoint == endpoint.name]
        cpu = {(t.configuration, t.round): t.cpu_us for t in mine}
        wall = {(t.configuration, t.round): t.wall_us for t in mine}
        best_off = min(cpu[(name, r)] for (name, r) in cpu if name == OFF.name)
        for configuration in CONFIGURATIONS:
            rounds = sorted(r for (name, r) in cpu if name == configuration.name)
            added = median([cpu[(configuration.name, r)] - cpu[(OFF.name, r)] for r in rounds])
            figures: dict[str, Any] = {
                "cpu_us": median([cpu[(configuration.name, r)] for r in rounds]),
                "wall_us": median([wall[(configuration.name, r)] for r in rounds]),
                "cpu_us_added_vs_off": added,
                "cpu_vs_off": per_round_ratio(cpu, configuration.name, OFF.name),
                "wall_vs_off": per_round_ratio(wall, configuration.name, OFF.name),
                "best_cpu_us": min(cpu[(configuration.name, r)] for r in rounds),
                "per_round_cpu_us": [round(cpu[(configuration.name, r)], 1) for r in rounds],
            }
            summary.setdefault(endpoint.name, {})[configuration.name] = figures
            print(
                f"{endpoint.name:<18}{configuration.name:<19}{figures['cpu_us']:9.0f}"
                f"{figures['wall_us']:9.0f}{added:+16.1f}{figures['cpu_vs_off']:11.3f}x"
                f"{figures['wall_vs_off']:12.3f}x{figures['best_cpu_us']:13.0f}"
                f"{figures['best_cpu_us'] - best_off:+10.1f}"
            )
    print(
        "  CPU: this process's (Django, the package, psycopg's client side, exporting threads),\n"
        "  not PostgreSQL's; CPU +us vs off: median of the per-batch differences;\n"
        "  best: the batch least disturbed (the lowest CPU time), against off's best"
    )
    print()
    print("CPU microseconds per request, per batch:")
    for endpoint in ENDPOINTS:
        for configuration in CONFIGURATIONS:
            values = summary[endpoint.name][configuration.name]["per_round_cpu_us"]
            print(
                f"  {endpoint.name:<18}{configuration.name:<19}"
                + " ".join(f"{value:8.1f}" for value in values)
            )
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per HTTP run")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds per endpoint, once")
    parser.add_argument("--requests", type=int, default=200, help="in-process requests per batch")
    parser.add_argument(
        "--batches", type=int, default=15, help="in-process batches per configuration and endpoint"
    )
    parser.add_argument("--threads", type=int, default=2, help="wrk threads")
    parser.add_argument("--connections", type=int, default=8, help="wrk connections")
    parser.add_argument("--workers", type=int, default=2, help="gunicorn sync workers")
    parser.add_argument("--skip", choices=("http", "in-process"), action="append", default=[])
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--keep", action="store_true", help="keep the database")
    parser.add_argument("--in-process-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.in_process_child:
        return in_process_child()
    if "http" not in args.skip and shutil.which("wrk") is None:
        print("wrk is not installed (Debian: apt-get install wrk)", file=sys.stderr)
        return 2
    # Every configuration sets its own; one inherited would change "off" and the others.
    os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)

    facts = machine()
    started = time.monotonic()
    problems: list[str] = []
    summary: dict[str, Any] = {"facts": facts}
    scratch = Path(tempfile.mkdtemp(prefix="idem-telemetry-"))
    try:
        with Database(postgres_url(), "idem_bench_telemetry", keep=args.keep) as database:
            with database.connect() as connection:
                facts.update(server_facts(connection))
            migrate(database)
            facts["load_before"] = load_average()
            print(
                f"{facts['cpus']} x {facts['cpu']}, {facts['memory']}, Python "
                f"{facts['python']}, PostgreSQL {facts['server_version']} (synchronous_commit "
                f"{facts['synchronous_commit']}), commit {facts['commit']}; load average "
                f"{facts['load_before']}",
                flush=True,
            )
            timings: list[Timing] = []
            if "in-process" not in args.skip:
                timings, recorded = in_process(args, database, scratch, problems)
                summary["in_process_recorded"] = recorded
            runs: list[HttpRun] = []
            if "http" not in args.skip:
                results = Results()
                with contextlib.ExitStack() as stack:
                    servers = [
                        Served(
                            configuration,
                            stack.enter_context(
                                Gunicorn(
                                    database,
                                    workers=args.workers,
                                    env=configuration_env(configuration, scratch),
                                    args=("-c", GUNICORN_CONFIG),
                                )
                            ),
                            replay_key=f"{uuid.uuid4().hex[:8]}-replay-{configuration.slug}",
                        )
                        for configuration in CONFIGURATIONS
                    ]
                    measure_http(args, servers, database, results, runs)
                    summary["http_recorded"] = http_recorded(args, servers, problems)
                    for served in servers:
                        problems.extend(
                            f"gunicorn log, {served.configuration.name}: {line}"
                            for line in served.server.problems()[:10]
                        )
                problems.extend(results.problems)
            facts["load_after"] = load_average()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    facts["elapsed_s"] = f"{time.monotonic() - started:.0f}"
    if timings:
        summary["in_process"] = report_in_process(args, timings)
    if runs:
        summary["http"] = report_http(args, runs)
    for what, where in (("in_process_recorded", "in-process"), ("http_recorded", "HTTP")):
        if what in summary:
            print()
            print(f"what each configuration recorded ({where}):")
            for name, line in summary[what].items():
                print(f"  {name:<19}{line}")
    if problems:
        print("\nPROBLEMS:")
        for problem in problems:
            print(f"  {problem}")
    summary["problems"] = problems
    print(
        f"\nload average before {facts['load_before']}, after {facts['load_after']}; "
        f"wall time {facts['elapsed_s']} s"
    )
    if args.json:
        summary["http_runs"] = [
            {"configuration": entry.configuration, **vars(entry.run)} for entry in runs
        ]
        summary["in_process_timings"] = [vars(timing) for timing in timings]
        summary["arguments"] = {k: str(v) for k, v in vars(args).items()}
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
