#!/usr/bin/env python3
"""Run the whole test suite: once on SQLite, once on PostgreSQL.

    python runtests.py [pytest arguments]

The PostgreSQL pass uses POSTGRES_URL (default: the local server's `test`
database; pytest-django creates and drops a test database beside it). When
the server cannot be reached the pass is skipped with a notice, unless
IDEMPOTENCY_REQUIRE_SERVICES=1 (as in CI), which makes that a failure.
"""

from __future__ import annotations

import os
import subprocess
import sys

POSTGRES_URL = os.environ.get("POSTGRES_URL", "postgres://postgres@127.0.0.1:5432/test")
REQUIRED = os.environ.get("IDEMPOTENCY_REQUIRE_SERVICES") == "1"


def postgres_problem(url: str) -> str | None:
    try:
        import psycopg

        with psycopg.connect(url, connect_timeout=3) as connection:
            connection.execute("SELECT 1")
    except Exception as exc:
        return " ".join(str(exc).split()) or type(exc).__name__
    return None


def run_pass(name: str, extra_env: dict[str, str], args: list[str]) -> int:
    print(f"\n===== {name} =====", flush=True)
    env = {**os.environ, **extra_env}
    return subprocess.call([sys.executable, "-m", "pytest", *args], env=env)


def main(args: list[str]) -> int:
    env_without_url = {"DATABASE_URL": ""}
    results = {"SQLite": run_pass("SQLite pass", env_without_url, args)}
    problem = postgres_problem(POSTGRES_URL)
    if problem is None or REQUIRED:
        results["PostgreSQL"] = run_pass("PostgreSQL pass", {"DATABASE_URL": POSTGRES_URL}, args)
    else:
        print(
            f"\n===== PostgreSQL pass skipped: {POSTGRES_URL} is not reachable ({problem}). "
            "Set POSTGRES_URL, or IDEMPOTENCY_REQUIRE_SERVICES=1 to make this a failure. ====="
        )
    print("\n===== summary =====")
    for name, code in results.items():
        print(f"{name:>10}: {'passed' if code == 0 else f'FAILED (exit {code})'}")
    return max(results.values())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
