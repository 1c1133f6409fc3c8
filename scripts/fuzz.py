#!/usr/bin/env python3
"""A long fuzzing run of the suite's hostile-input properties.

    .venv/bin/python scripts/fuzz.py                      # 20,000 examples per test
    .venv/bin/python scripts/fuzz.py --examples 5000 --seed 1234
    .venv/bin/python scripts/fuzz.py --database-url postgres://postgres@127.0.0.1:5432/test
    .venv/bin/python scripts/fuzz.py -k "hostile_bodies or key_header"

Runs the same tests as the suite (tests/test_hostile_input.py,
tests/test_tenant_isolation.py, tests/test_schemathesis.py) through pytest,
in fuzzing mode: ``IDEMPOTENCY_FUZZ_EXAMPLES`` examples per property test,
random inputs instead of the suite's fixed set (``--seed`` makes a run
repeatable; a failure prints the seed and the shrunk example). The state
machines run ``--stateful-examples`` sequences (default: examples / 20) of up
to 40 requests each.

At the end it prints, per test and in total, the number of generated inputs,
the number of requests sent, and the outcomes seen (status and code, or
"view" for the view's own answer, "replay" for a stored one). The same
pytest invocation works without this script:

    IDEMPOTENCY_FUZZ_EXAMPLES=20000 IDEMPOTENCY_FUZZ_REPORT=/tmp/fuzz.json \\
        .venv/bin/python -m pytest tests/test_hostile_input.py \\
        tests/test_tenant_isolation.py tests/test_schemathesis.py -p no:cacheprovider \\
        -p no:schemathesis
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = [
    "tests/test_hostile_input.py",
    "tests/test_tenant_isolation.py",
    "tests/test_schemathesis.py",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=20_000, help="examples per test")
    parser.add_argument(
        "--stateful-examples",
        type=int,
        default=None,
        help="sequences per state machine (default: examples / 20)",
    )
    parser.add_argument("--seed", type=int, default=None, help="hypothesis seed")
    parser.add_argument("--database-url", default="", help="DATABASE_URL (default: SQLite)")
    parser.add_argument("-k", dest="keyword", default=None, help="pytest -k expression")
    parser.add_argument("--report", default=None, help="also write the counters here (JSON)")
    parser.add_argument("tests", nargs="*", default=TESTS, help="test files (default: all three)")
    args = parser.parse_args(argv)

    report = Path(args.report or tempfile.mkstemp(prefix="fuzz-", suffix=".json")[1])
    report.write_text("{}")
    env = {
        **os.environ,
        "IDEMPOTENCY_FUZZ_EXAMPLES": str(args.examples),
        "IDEMPOTENCY_FUZZ_STATEFUL_EXAMPLES": str(
            args.stateful_examples or max(10, args.examples // 20)
        ),
        "IDEMPOTENCY_FUZZ_REPORT": str(report),
        "DATABASE_URL": args.database_url,
    }
    command = [sys.executable, "-m", "pytest", *args.tests, "-q"]
    # No schemathesis pytest plugin: it blanks Hypothesis's failing-example output.
    command += ["-p", "no:cacheprovider", "-p", "no:schemathesis"]
    if args.seed is not None:
        command.append(f"--hypothesis-seed={args.seed}")
    if args.keyword:
        command += ["-k", args.keyword]
    print("running:", " ".join(command), flush=True)
    started = time.monotonic()
    code = subprocess.call(command, cwd=ROOT, env=env)
    elapsed = time.monotonic() - started
    summarise(json.loads(report.read_text() or "{}"), elapsed)
    if not args.report:
        report.unlink()
    return code


def summarise(counters: dict[str, dict[str, object]], elapsed: float) -> None:
    print("\n===== fuzzing summary =====")
    total_inputs = total_requests = 0
    by_status: Counter[str] = Counter()
    for test, data in sorted(counters.items()):
        inputs = int(data["inputs"])  # type: ignore[call-overload]
        requests = int(data["requests"])  # type: ignore[call-overload]
        outcomes: dict[str, int] = data["outcomes"]  # type: ignore[assignment]
        total_inputs += inputs
        total_requests += requests
        print(f"\n{test}: {inputs} generated inputs, {requests} requests")
        for label, count in sorted(outcomes.items(), key=lambda item: (-item[1], item[0])):
            print(f"  {count:9d}  {label}")
            by_status[_status_and_code(label)] += count
    print(f"\nall tests: {total_inputs} generated inputs, {total_requests} requests", end="")
    print(f" in {elapsed:.0f} s")
    print("outcomes by status and code:")
    for label, count in sorted(by_status.items()):
        print(f"  {count:9d}  {label}")


def _status_and_code(label: str) -> str:
    """'POST /v1/payments -> 400 idempotency_key_invalid' -> '400 idempotency_key_invalid'."""
    return label.split(" -> ", 1)[-1]


if __name__ == "__main__":
    sys.exit(main())
