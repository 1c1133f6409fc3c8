#!/usr/bin/env python3
"""Run the whole test suite: on SQLite, on PostgreSQL and on MariaDB.

    python runtests.py [--coverage] [pytest arguments]
    python runtests.py --configurations [NAME ...] [--databases sqlite,postgres] [--jobs N]

The second form runs the configuration matrix (tests/configurations/): the
guarantee tests (``-m guarantees``) under each named real-project
configuration (when none is named: every one not marked ``default=False``),
on each database it applies to, every cell a pytest process of its own, and
prints one table. Cell logs go to ``.configurations/`` (or
``IDEMPOTENCY_MATRIX_LOGS``).

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
    env = {**os.environ, "DATABASE_URL": database_url}
    runner = ["-m", "coverage", "run", "-m", "pytest"] if coverage else ["-m", "pytest"]
    return subprocess.call([sys.executable, *runner, *args], env=env)


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


def main(args: list[str]) -> int:
    if args[:1] == ["--configurations"]:
        from tests.configurations.matrix import main as run_matrix

        urls = {"sqlite": "", "postgres": POSTGRES_URL, "mariadb": MARIADB_URL}
        return run_matrix(args[1:], urls, unreachable, required=REQUIRED)
    coverage = args[:1] == ["--coverage"]
    if coverage:
        args = args[1:]
        subprocess.call([sys.executable, "-m", "coverage", "erase"])
    results = {"SQLite": run_pass("SQLite", "", args, coverage=coverage)}
    for name, variable, url in (
        ("PostgreSQL", "POSTGRES_URL", POSTGRES_URL),
        ("MariaDB", "MARIADB_URL", MARIADB_URL),
    ):
        problem = unreachable(url)
        if problem is None or REQUIRED:
            results[name] = run_pass(name, url, args, coverage=coverage)
        else:
            print(
                f"\n===== {name} pass skipped: {url} is not reachable ({problem}). Set "
                f"{variable}, or IDEMPOTENCY_REQUIRE_SERVICES=1 to make this a failure. ====="
            )
    judged = not args and len(results) == 3
    if coverage:
        gate = coverage_report(judged)
    print("\n===== summary =====")
    for name, code in results.items():
        print(f"{name:>10}: {'passed' if code == 0 else f'FAILED (exit {code})'}")
    if coverage:
        verdict = "passed" if gate == 0 else f"FAILED (exit {gate})"
        print(f"{'coverage':>10}: {verdict if judged else 'reported, not judged'}")
        return max(*results.values(), gate)
    return max(results.values())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
