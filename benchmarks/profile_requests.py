#!/usr/bin/env python3
"""Where a protected request's time goes: per-request breakdown and a pyinstrument profile.

    .venv/bin/python benchmarks/profile_requests.py [--requests 2000] [--html DIR]
                                                    [--table-only | --statements]

Runs the benchmark project (benchmarks/benchproject) in this process on a
fresh PostgreSQL database, through Django's WSGI handler (no web server, no
network hop to a client), one request at a time:

1. for each endpoint of benchmarks/http.py (no write, unprotected, the first
   executions and replays of ``@idempotent``, ``@idempotent(optimistic=True)``
   and the hand-written floors: claim first, lookup first, optimistic; the
   hand-written single-transaction floor): ``--requests``
   requests after a warm-up, reporting the median wall time per request,
   how much of it was spent inside database calls (``execute`` and the
   commits, measured with an execute wrapper and a commit hook), the
   statements per request, the Python time that remains, the CPU time of
   this process and that of the PostgreSQL backend serving it (read from
   /proc when the server is local; both sides share the machine's cores);
   checking that each first execution wrote one payment row and no replay
   any (``--table-only`` stops here; ``--statements`` then prints the
   backend's CPU per request by statement and COMMIT, for the floors and
   the package, and stops);
2. profiles ``--requests`` protected first executions, as many replays and
   as many optimistic first executions with pyinstrument (``pip install
   pyinstrument``) and prints the call trees (and writes HTML reports to
   ``--html``);
3. counts the calls of a few functions per request (settings reads,
   fingerprints, JSON encodes, savepoints) with a deterministic tracer;
4. drops the database.
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import argparse  # noqa: E402
import cProfile  # noqa: E402
import io  # noqa: E402
import os  # noqa: E402
import pstats  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks.benchlib import (  # noqa: E402
    BENCH_SETTINGS,
    Database,
    machine,
    migrate,
    postgres_url,
)

BODY = b'{"amount": 1250, "currency": "EUR"}'
#: The endpoints profiled by function after the per-request table.
PROFILED = ("protected", "protected replay", "optimistic")


class DatabaseTimer:
    """Wall time spent in the database driver: statements, and commits/rollbacks."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.statements = 0

    def __call__(
        self, execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any
    ) -> Any:
        started = time.perf_counter()
        try:
            return execute(sql, params, many, context)
        finally:
            self.seconds += time.perf_counter() - started
            self.statements += 1


@contextmanager
def timed_commits(connection: Any, timer: DatabaseTimer) -> Iterator[None]:
    """Count commit/rollback and BEGIN round trips as database time too."""
    original_commit = connection._commit
    original_rollback = connection._rollback

    def commit() -> Any:
        started = time.perf_counter()
        try:
            return original_commit()
        finally:
            timer.seconds += time.perf_counter() - started

    def rollback() -> Any:
        started = time.perf_counter()
        try:
            return original_rollback()
        finally:
            timer.seconds += time.perf_counter() - started

    connection._commit, connection._rollback = commit, rollback
    try:
        yield
    finally:
        connection._commit, connection._rollback = original_commit, original_rollback


def backend_cpu_seconds(pid: int | None) -> float | None:
    """CPU time of the PostgreSQL backend serving this process (a local server), or None.

    From ``/proc/PID/schedstat`` (nanoseconds) where the kernel keeps it, else
    from ``/proc/PID/stat`` (clock ticks, a hundredth of a second here).
    """
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/schedstat") as schedstat:
            return int(schedstat.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None  # the server runs elsewhere, or as a user we cannot see
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def statement_kind(sql: str) -> str:
    """``INSERT benchapp_payment``, ``SELECT django_idempotency_record``: verb and table."""
    table = _TABLE.search(sql)
    return f"{sql.split()[0].upper()} {table.group(0) if table else ''}".strip()


#: The tables of the benchmark project's statements.
_TABLE = re.compile(r"benchapp_\w+|django_idempotency_\w+")


class BackendTimer:
    """The backend's CPU time around each statement and commit, by kind of statement."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.seconds: dict[str, float] = {}

    def add(self, kind: str, started: float | None) -> None:
        ended = backend_cpu_seconds(self.pid)
        if started is not None and ended is not None:
            self.seconds[kind] = self.seconds.get(kind, 0.0) + ended - started

    def __call__(
        self, execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any
    ) -> Any:
        started = backend_cpu_seconds(self.pid)
        try:
            return execute(sql, params, many, context)
        finally:
            self.add(statement_kind(sql), started)


@contextmanager
def backend_commits(connection: Any, timer: BackendTimer) -> Iterator[None]:
    """The backend's CPU time of each COMMIT (which carries the WAL flush's wait)."""
    original_commit = connection._commit

    def commit() -> Any:
        started = backend_cpu_seconds(timer.pid)
        try:
            return original_commit()
        finally:
            timer.add("COMMIT", started)

    connection._commit = commit
    try:
        yield
    finally:
        connection._commit = original_commit


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--html", type=Path, help="write pyinstrument HTML reports here")
    parser.add_argument(
        "--table-only", action="store_true", help="print the per-request table, no profiles"
    )
    parser.add_argument(
        "--statements",
        action="store_true",
        help="after the table: the database backend's CPU per request by statement (and "
        "COMMIT), for the floors and the package, then stop",
    )
    args = parser.parse_args(argv)

    with Database(postgres_url(), "idem_bench_profile") as database:
        migrate(database)
        os.environ["DATABASE_URL"] = database.url
        os.environ["DJANGO_SETTINGS_MODULE"] = BENCH_SETTINGS
        try:
            run(args)
        finally:
            from django.db import connections

            connections.close_all()
    return 0


def run(args: argparse.Namespace) -> None:
    import django

    django.setup()
    from django.core.handlers.wsgi import WSGIHandler
    from django.db import connection
    from django.test.client import RequestFactory

    handler = WSGIHandler()
    factory = RequestFactory()
    run_id = uuid.uuid4().hex[:8]
    counter = iter(range(10**9))

    def environ(path: str, key: str | None) -> dict[str, Any]:
        extra = {} if key is None else {"HTTP_IDEMPOTENCY_KEY": key}
        request = factory.post(path, BODY, content_type="application/json", **extra)
        return dict(request.environ)

    def call(path: str, key: str | None) -> int:
        captured: list[str] = []

        def start_response(status: str, headers: Any, exc_info: Any = None) -> None:
            captured.append(status)

        result = handler(environ(path, key), start_response)
        b"".join(result)
        result.close()
        return int(captured[0].split()[0])

    def first(path: str) -> Callable[[], int]:
        """A new key per request: first executions."""
        return lambda: call(path, f"{run_id}-{path.strip('/')}-{next(counter)}")

    def replay(path: str) -> Callable[[], int]:
        """One key per path: its first request executes, the others replay."""
        return lambda: call(path, f"{run_id}-replay")

    endpoints: list[tuple[str, Callable[[], int]]] = [
        ("no write", lambda: call("/no-write", None)),
        ("unprotected", lambda: call("/unprotected", None)),
        ("protected", first("/protected")),
        ("protected replay", replay("/protected")),
        ("optimistic", first("/protected-optimistic")),
        ("optimistic replay", replay("/protected-optimistic")),
        ("floor", first("/floor")),
        ("floor replay", replay("/floor")),
        ("floor lookup-first", first("/floor-lookup-first")),
        ("floor lookup-first replay", replay("/floor-lookup-first")),
        ("floor optimistic", first("/floor-optimistic")),
        ("floor optimistic replay", replay("/floor-optimistic")),
        ("floor single", first("/floor-single")),
    ]
    profiled = [(name, send) for name, send in endpoints if name in PROFILED]
    info = machine()
    print(
        f"{info['cpus']} x {info['cpu']}, Python {info['python']}, commit {info['commit']}; "
        f"in-process WSGI, one request at a time, {args.requests} requests per endpoint\n"
    )
    print(
        f"{'endpoint':<27}{'wall ms':>9}{'in database ms':>16}{'rest ms':>9}"
        f"{'CPU ms (this process)':>23}{'statements':>11}{'CPU ms (database)':>19}"
    )
    connection.ensure_connection()
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        backend_pid = int(cursor.fetchone()[0])

    def payments() -> int:
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM benchapp_payment")
            return int(cursor.fetchone()[0])

    for name, send in endpoints:
        for _ in range(200):
            status = send()
            assert status == 201, (name, status)
        rows_before = payments()
        backend_before = backend_cpu_seconds(backend_pid)
        walls: list[float] = []
        cpus: list[float] = []
        in_db: list[float] = []
        statements: list[int] = []
        for _ in range(args.requests):
            timer = DatabaseTimer()
            with connection.execute_wrapper(timer), timed_commits(connection, timer):
                cpu_started = time.process_time()
                started = time.perf_counter()
                status = send()
                walls.append(time.perf_counter() - started)
                cpus.append(time.process_time() - cpu_started)
            assert status == 201, (name, status)
            in_db.append(timer.seconds)
            statements.append(timer.statements)
        backend_after = backend_cpu_seconds(backend_pid)
        written = payments() - rows_before
        expected = 0 if name == "no write" or name.endswith("replay") else args.requests
        assert written == expected, f"{name}: {written} payment rows, expected {expected}"
        wall = statistics.median(walls) * 1000
        db = statistics.median(in_db) * 1000
        cpu = statistics.fmean(cpus) * 1000
        if backend_before is None or backend_after is None:
            backend = f"{'n/a':>19}"
        else:
            backend = f"{(backend_after - backend_before) / args.requests * 1000:19.3f}"
        print(
            f"{name:<27}{wall:9.3f}{db:16.3f}{wall - db:9.3f}{cpu:23.3f}"
            f"{statistics.median(statements):11.0f}{backend}"
        )

    if args.statements:
        by_statement(endpoints, backend_pid, args.requests)
        return
    if args.table_only:
        return
    from pyinstrument import Profiler

    for name, send in profiled:
        profiler = Profiler(interval=0.0002)
        profiler.start()
        for _ in range(args.requests):
            send()
        profiler.stop()
        print(f"\n===== pyinstrument: {args.requests} x {name} =====")
        print(profiler.output_text(unicode=False, color=False, short_mode=False))
        if args.html:
            args.html.mkdir(parents=True, exist_ok=True)
            (args.html / f"{name.replace(' ', '_')}.html").write_text(profiler.output_html())

    # CPU time by function (cProfile with a CPU clock: what other processes on
    # the machine do changes nothing), and how often the hot helpers run.
    for name, send in profiled:
        profile = cProfile.Profile(time.process_time)
        n = args.requests
        profile.enable()
        for _ in range(n):
            send()
        profile.disable()
        stream = io.StringIO()
        stats = pstats.Stats(profile, stream=stream)
        print(f"\n===== CPU time by function: {name} (cProfile, {n} requests) =====")
        stats.sort_stats("cumulative").print_stats(r"django_idempotency|benchapp", 30)
        print("\n".join(stream.getvalue().splitlines()[6:]))
        print(f"===== calls per request: {name} (cProfile, {n} requests) =====")
        wanted = (
            ("conf.py", "_get"),
            ("conf.py", "user_settings"),
            ("fingerprint.py", "request_fingerprint"),
            ("fingerprint.py", "_encode"),
            ("__init__.py", "dumps"),
            ("sealing.py", "seal"),
            ("sealing.py", "unseal"),
            ("transaction.py", "__enter__"),
            ("base.py", "savepoint"),
            ("utils.py", "execute"),
            ("signals.py", "notify"),
            ("dispatcher.py", "send_robust"),
            ("query.py", "first"),
            ("compiler.py", "as_sql"),
            ("compiler.py", "execute_sql"),
        )
        for (filename, line, function), row in sorted(stats.stats.items()):  # type: ignore[attr-defined]
            for wanted_file, wanted_function in wanted:
                if filename.endswith(wanted_file) and function == wanted_function:
                    calls = row[1]
                    cumulative = row[3]
                    where = f"{'/'.join(Path(filename).parts[-2:])}:{line}({function})"
                    print(
                        f"  {where:<48} {calls / n:6.1f} calls/request "
                        f"{cumulative / n * 1e6:8.1f} us/request (cumulative, under cProfile)"
                    )


#: The endpoints whose statements ``--statements`` times, side by side.
BY_STATEMENT = (
    "floor",
    "protected",
    "floor optimistic",
    "optimistic",
    "floor replay",
    "protected replay",
    "optimistic replay",
)


def by_statement(
    endpoints: list[tuple[str, Callable[[], int]]], backend_pid: int, requests: int
) -> None:
    """The backend's CPU per request, by statement, for the floors and the package."""
    from django.db import connection

    print(f"\ndatabase backend CPU ms per request, by statement ({requests} requests each):")
    for name, send in endpoints:
        if name not in BY_STATEMENT:
            continue
        timer = BackendTimer(backend_pid)
        with connection.execute_wrapper(timer), backend_commits(connection, timer):
            for _ in range(requests):
                status = send()
                assert status == 201, (name, status)
        total = sum(timer.seconds.values())
        parts = ", ".join(
            f"{kind} {seconds / requests * 1000:.3f}"
            for kind, seconds in sorted(timer.seconds.items(), key=lambda item: -item[1])
        )
        print(f"  {name:<19} {total / requests * 1000:6.3f}  = {parts}")


if __name__ == "__main__":
    sys.exit(main())
