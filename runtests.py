#!/usr/bin/env python3
"""Run the whole test suite: on SQLite, on PostgreSQL and on MariaDB.

    python runtests.py [--coverage] [--sequential] [pytest arguments]
    python runtests.py --configurations [NAME ...] [--databases sqlite,postgres] [--jobs N]

The second form runs the configuration matrix (tests/configurations/): the
guarantee tests (``-m guarantees``) under each named real-project
configuration (when none is named: every one not marked ``default=False``),
on each database it applies to, every cell a pytest process of its own, and
prints one table. Cell logs go to ``.configurations/`` (or
``IDEMPOTENCY_MATRIX_LOGS``).

The SQLite pass runs every test; the server passes only the tests that may
reach a database (``--database-tests-only``, tests/selection.py): a test
that reaches none proves the same thing on every database, once is enough.

The passes run side by side in three lanes, each pass's output shown whole
when it ends and kept in ``.test-passes/``: the PostgreSQL pass's live
tests (``-m live``: real servers and workers, mostly waiting on them), the
SQLite pass, and the PostgreSQL pass's other tests then the MariaDB pass.
With pytest arguments the PostgreSQL pass is one process (beside SQLite then
MariaDB); ``--sequential`` runs the three passes one by one, output as it
comes.

The server passes use POSTGRES_URL and MARIADB_URL (default: the local
servers' `test` databases; pytest-django creates and drops a test database
beside them). When a server cannot be reached its pass is skipped with a
notice, unless IDEMPOTENCY_REQUIRE_SERVICES=1 (as in CI), which makes that
a failure.

With ``--coverage`` (as ``make test`` runs it) each pass runs under
coverage.py, and so does every Python process the tests start (gunicorn and
its workers, uvicorn, Celery workers, management commands: ``[run] patch``
in pyproject.toml). The data of all passes is combined and reported at the
end, branch coverage of ``django_idempotency``. The report's ``fail_under``
gate applies to the whole suite on all three databases only: with pytest
arguments, or a server pass skipped, the report is printed and not judged.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

POSTGRES_URL = os.environ.get("POSTGRES_URL", "postgres://postgres@127.0.0.1:5432/test")
MARIADB_URL = os.environ.get("MARIADB_URL", "mysql://root@127.0.0.1:3306/test")
REQUIRED = os.environ.get("IDEMPOTENCY_REQUIRE_SERVICES") == "1"


def unreachable(url: str) -> str | None:
    """Why the database server at ``url`` cannot be used, or None."""
    try:
        if url.startswith("mysql"):
            import pymysql

            parts = urlsplit(url)
            pymysql.connect(
                host=parts.hostname or "127.0.0.1",
                port=parts.port or 3306,
                user=parts.username or "root",
                password=parts.password or "",
                connect_timeout=3,
            ).close()
        else:
            import psycopg

            with psycopg.connect(url, connect_timeout=3) as connection:
                connection.execute("SELECT 1")
    except Exception as exc:  # any failure means "not reachable"
        return " ".join(str(exc).split()) or type(exc).__name__
    return None


def run_pass(name: str, database_url: str, args: list[str], *, coverage: bool) -> int:
    print(f"\n===== {name} pass =====", flush=True)
    command = _pass_command(args, coverage=coverage, server=bool(database_url))
    return subprocess.call(command, env=_pass_env(database_url))


def _pass_command(args: list[str], *, coverage: bool, server: bool) -> list[str]:
    runner = ["-m", "coverage", "run", "-m", "pytest"] if coverage else ["-m", "pytest"]
    return [sys.executable, *runner, *(SERVER_PASS_OPTIONS if server else ()), *args]


#: The server passes leave the tests that reach no database to the SQLite
#: pass, which runs every test (tests/selection.py says which and why).
SERVER_PASS_OPTIONS = ("--database-tests-only",)


def _pass_env(database_url: str) -> dict[str, str]:
    return {**os.environ, "DATABASE_URL": database_url}


#: Where the passes that run side by side write their output, shown whole
#: when each ends (interleaved lines of two passes would be unreadable).
PASS_LOGS = Path(os.environ.get("IDEMPOTENCY_PASS_LOGS", ".test-passes"))


#: A pass (or a part of one): its name, its DATABASE_URL, the pytest
#: arguments that select its part of the suite.
Pass = tuple[str, str, tuple[str, ...]]


def run_side_by_side(lanes: list[list[Pass]], args: list[str], *, coverage: bool) -> dict[str, int]:
    """Each lane's passes one after another, the lanes at the same time.

    The PostgreSQL pass's live tests spend most of their time waiting (on
    the servers and workers they start, on leases running out), time the
    other passes can use. Every pass has its own test databases (named by
    pid) and its own coverage data file, so nothing they write collides.
    """
    PASS_LOGS.mkdir(exist_ok=True)
    printing = threading.Lock()
    results: dict[str, int] = {}

    def run_lane(lane: list[Pass]) -> None:
        for name, url, selection in lane:
            log = PASS_LOGS / f"{name.lower().replace(' ', '-')}.log"
            started = time.monotonic()
            with log.open("w") as output:
                code = subprocess.call(
                    _pass_command([*selection, *args], coverage=coverage, server=bool(url)),
                    env=_pass_env(url),
                    stdout=output,
                    stderr=subprocess.STDOUT,
                )
            results[name] = code
            seconds = time.monotonic() - started
            with printing:
                print(f"\n===== {name} pass ({seconds:.0f} s; log: {log}) =====", flush=True)
                sys.stdout.write(log.read_text(errors="replace"))
                sys.stdout.flush()

    with printing:
        names = " | ".join(" then ".join(name for name, _, _ in lane) for lane in lanes)
        print(f"===== passes side by side: {names} =====", flush=True)
    threads = [threading.Thread(target=run_lane, args=(lane,)) for lane in lanes if lane]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def coverage_report(judged: bool) -> int:
    """Combine every process's data, print the report; its exit code if ``judged``."""
    coverage = [sys.executable, "-m", "coverage"]
    print("\n===== coverage (branch, django_idempotency) =====", flush=True)
    subprocess.call([*coverage, "combine", "--quiet"])
    if judged:
        return subprocess.call([*coverage, "report"])
    subprocess.call([*coverage, "report", "--fail-under=0"])
    print("(not judged against fail_under: not the whole suite on all three databases)")
    return 0


ALL_DATABASES = {"SQLite", "PostgreSQL", "MariaDB"}
#: The two parts of the PostgreSQL pass when it is split (the whole suite).
POSTGRES_LIVE = ("-m", "live")
POSTGRES_IN_PROCESS = ("-m", "not live")


def lanes(passes: list[tuple[str, str]], *, split: bool) -> list[list[Pass]]:
    """The passes in lanes that run side by side.

    The whole suite: the PostgreSQL pass's live tests alone (they mostly
    wait), the SQLite pass (every test, the longest in-process pass), the
    PostgreSQL pass's other tests then the MariaDB pass. With pytest
    arguments (which may select by marker or path themselves) the PostgreSQL
    pass stays one process, beside SQLite then MariaDB.
    """
    url = dict(passes)
    postgres, sqlite, mariadb = ("PostgreSQL" in url), ("SQLite" in url), ("MariaDB" in url)
    if not split:
        return [
            [("PostgreSQL", url["PostgreSQL"], ())] if postgres else [],
            [(name, url[name], ()) for name in ("SQLite", "MariaDB") if name in url],
        ]
    return [
        [("PostgreSQL live", url["PostgreSQL"], POSTGRES_LIVE)] if postgres else [],
        [("SQLite", url["SQLite"], ())] if sqlite else [],
        [
            *([("PostgreSQL", url["PostgreSQL"], POSTGRES_IN_PROCESS)] if postgres else []),
            *([("MariaDB", url["MariaDB"], ())] if mariadb else []),
        ],
    ]


def main(args: list[str]) -> int:
    if args[:1] == ["--configurations"]:
        from tests.configurations.matrix import main as run_matrix

        urls = {"sqlite": "", "postgres": POSTGRES_URL, "mariadb": MARIADB_URL}
        return run_matrix(args[1:], urls, unreachable, required=REQUIRED)
    coverage = args[:1] == ["--coverage"]
    if coverage:
        args = args[1:]
        subprocess.call([sys.executable, "-m", "coverage", "erase"])
    sequential = args[:1] == ["--sequential"]
    if sequential:
        args = args[1:]
    passes = [("SQLite", "")]
    for name, variable, url in (
        ("PostgreSQL", "POSTGRES_URL", POSTGRES_URL),
        ("MariaDB", "MARIADB_URL", MARIADB_URL),
    ):
        problem = unreachable(url)
        if problem is None or REQUIRED:
            passes.append((name, url))
        else:
            print(
                f"\n===== {name} pass skipped: {url} is not reachable ({problem}). Set "
                f"{variable}, or IDEMPOTENCY_REQUIRE_SERVICES=1 to make this a failure. ====="
            )
    if sequential:
        results = {name: run_pass(name, url, args, coverage=coverage) for name, url in passes}
    else:
        results = run_side_by_side(lanes(passes, split=not args), args, coverage=coverage)
    # Every test on all three databases: the PostgreSQL pass may be two parts.
    judged = not args and {name.split()[0] for name in results} == ALL_DATABASES
    if coverage:
        gate = coverage_report(judged)
    print("\n===== summary =====")
    for name, code in results.items():
        print(f"{name:>15}: {'passed' if code == 0 else f'FAILED (exit {code})'}")
    if coverage:
        verdict = "passed" if gate == 0 else f"FAILED (exit {gate})"
        print(f"{'coverage':>15}: {verdict if judged else 'reported, not judged'}")
        return max(*results.values(), gate)
    return max(results.values())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
