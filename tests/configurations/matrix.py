"""The configuration matrix runner: ``python runtests.py --configurations [NAME ...]``.

Every (configuration, database) cell runs the guarantee tests of its paths
(``-m guarantees``; those that reach no database in the configuration's
first cell only, tests/selection.py) as a pytest process of its own, with
``IDEMPOTENCY_TEST_CONFIGURATION`` and ``DATABASE_URL`` set (live servers
inherit both), ``--jobs`` cells at a time. One table at the end: cell,
passed / failed / skipped, seconds; then every failed test with the first
line of its error. Exit status 1 when any cell failed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tests.configurations import CONFIGURATIONS, DATABASES, ENVIRONMENT_VARIABLE, Configuration

REPO_ROOT = Path(__file__).resolve().parents[2]
LOGS_ENV = "IDEMPOTENCY_MATRIX_LOGS"
#: Trials per crash point in a cell (the full run uses 20, in `make test`).
CELL_CRASH_TRIALS = "3"


@dataclass
class Cell:
    configuration: Configuration
    database: str
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    seconds: float = 0.0
    #: Whether the cell also runs the tests that reach no database: one cell
    #: per configuration does (they may depend on the configuration, not on
    #: the database); the others pass ``--database-tests-only``.
    every_test: bool = True
    #: Why the cell did not run or did not finish (not a test failure).
    problem: str | None = None
    failures: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.configuration.name} / {self.database}"

    @property
    def ok(self) -> bool:
        return self.problem is None and self.failed == 0

    @property
    def slug(self) -> str:
        return f"{self.configuration.name}-{self.database}"


def _parse_junit(cell: Cell, path: Path) -> None:
    suite = ElementTree.parse(path).getroot()
    if suite.tag == "testsuites":
        suite = suite[0]
    tests, skipped = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
    failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
    cell.passed, cell.failed, cell.skipped = tests - failed - skipped, failed, skipped
    for case in suite.iter("testcase"):
        for outcome in (*case.findall("failure"), *case.findall("error")):
            module = case.get("classname", "").replace(".", "/")
            message = (outcome.get("message") or outcome.text or "").strip()
            first_line = message.splitlines()[0][:200] if message else "(no message)"
            cell.failures.append(f"{module}.py::{case.get('name')}: {first_line}")


def run_cell(cell: Cell, urls: Mapping[str, str], logs: Path, pytest_args: list[str]) -> Cell:
    configuration = cell.configuration
    junit = logs / f"{cell.slug}.xml"
    env = {
        **os.environ,
        ENVIRONMENT_VARIABLE: configuration.name,
        "DATABASE_URL": urls[cell.database],
        **{name: value.format(**urls) for name, value in configuration.environment.items()},
    }
    env.setdefault("CRASH_TRIALS", CELL_CRASH_TRIALS)
    if cell.database == "postgres":
        env["IDEMPOTENCY_TEST_POSTGRES_URL"] = urls[cell.database]
    command = [
        *configuration.wrapper,
        sys.executable, "-m", "pytest", "-m", "guarantees", "-q", "-p", "no:cacheprovider",
        "--hypothesis-profile=matrix",
        f"--junitxml={junit}", *configuration.paths(cell.database),
        *(() if cell.every_test else ("--database-tests-only",)), *pytest_args,
    ]  # fmt: skip
    started = time.monotonic()
    with (logs / f"{cell.slug}.log").open("w") as log:
        log.write(f"$ {ENVIRONMENT_VARIABLE}={configuration.name} {' '.join(command)}\n")
        log.flush()
        code = subprocess.call(
            command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )
    cell.seconds = time.monotonic() - started
    if junit.exists():
        _parse_junit(cell, junit)
    if code == 5:
        cell.problem = "no tests collected"
    elif code not in (0, 1):
        cell.problem = f"pytest exited with {code}, see {logs / (cell.slug + '.log')}"
    elif code == 1 and cell.failed == 0:
        # e.g. the CI policy on skipped PostgreSQL tests, reported after the run.
        cell.problem = f"pytest failed the session, see {logs / (cell.slug + '.log')}"
    return cell


def leave_database_independent_tests_to_one_cell(cells: list[Cell]) -> None:
    """The first cell of each configuration runs every test, the others only database tests."""
    seen: set[str] = set()
    for cell in cells:
        cell.every_test = cell.configuration.name not in seen
        seen.add(cell.configuration.name)


def table(cells: list[Cell]) -> list[str]:
    width = max(len(cell.name) for cell in cells)
    lines = [
        f"{'cell':<{width}}  {'passed':>6}  {'failed':>6}  {'skipped':>7}  {'seconds':>7}  result",
        "-" * (width + 48),
    ]
    for cell in cells:
        result = "ok" if cell.ok else (cell.problem or "FAILED")
        lines.append(
            f"{cell.name:<{width}}  {cell.passed:>6}  {cell.failed:>6}  {cell.skipped:>7}  "
            f"{cell.seconds:>7.1f}  {result}"
        )
    return lines


def main(
    args: list[str],
    urls: Mapping[str, str],
    unreachable: Callable[[str], str | None],
    *,
    required: bool,
) -> int:
    parser = argparse.ArgumentParser(prog="runtests.py --configurations")
    parser.add_argument("names", nargs="*", help="configurations (default: all)")
    parser.add_argument("--databases", default=",".join(DATABASES))
    parser.add_argument("--jobs", type=int, default=2, help="cells at a time (default 2)")
    parser.add_argument("--list", action="store_true", help="list the cells and exit")
    options, pytest_args = parser.parse_known_args(args)
    if pytest_args[:1] == ["--"]:
        pytest_args = pytest_args[1:]
    unknown = [name for name in options.names if name not in CONFIGURATIONS]
    if unknown:
        parser.error(f"unknown configuration(s) {unknown}; known: {', '.join(CONFIGURATIONS)}")
    databases = [name.strip() for name in options.databases.split(",") if name.strip()]
    cells = [
        Cell(configuration, database)
        for configuration in (
            [CONFIGURATIONS[name] for name in options.names]
            or [configuration for configuration in CONFIGURATIONS.values() if configuration.default]
        )
        for database in configuration.databases
        if database in databases
    ]
    leave_database_independent_tests_to_one_cell(cells)
    if options.list:
        for cell in cells:
            paths = " ".join(cell.configuration.paths(cell.database))
            print(f"{cell.name}: {cell.configuration.summary}\n    {paths}")
        return 0

    logs = Path(os.environ.get(LOGS_ENV) or REPO_ROOT / ".configurations")
    logs.mkdir(parents=True, exist_ok=True)
    runnable: list[Cell] = []
    for cell in cells:
        if cell.database != "sqlite" and not required:
            problem = unreachable(urls[cell.database])
            if problem is not None:
                cell.problem = f"not run: {cell.database} unreachable ({problem})"
                continue
        wrapper = cell.configuration.wrapper
        if wrapper and shutil.which(wrapper[0]) is None:
            cell.problem = (
                f"not run: `{wrapper[0]}` is not installed (apt-get install {wrapper[0]})"
            )
            continue
        runnable.append(cell)

    print(f"===== configuration matrix: {len(cells)} cells, {options.jobs} at a time =====")
    lock = threading.Lock()
    started = time.monotonic()

    def run(cell: Cell) -> None:
        run_cell(cell, urls, logs, pytest_args)
        with lock:
            status = "ok" if cell.ok else (cell.problem or f"{cell.failed} FAILED")
            print(f"  {cell.name}: {status} ({cell.seconds:.0f}s)", flush=True)

    # The cells with live servers first: they take longest.
    order = sorted(runnable, key=lambda cell: -len(cell.configuration.paths(cell.database)))
    with ThreadPoolExecutor(max_workers=max(1, options.jobs)) as pool:
        list(pool.map(run, order))

    lines = table(cells)
    lines.append(f"total: {time.monotonic() - started:.0f}s wall clock; logs in {logs}")
    failures = [(cell, failure) for cell in cells for failure in cell.failures]
    if failures:
        lines += ["", "failed tests:"]
        lines += [f"  [{cell.name}] {failure}" for cell, failure in failures]
    print("\n===== configuration matrix =====")
    print("\n".join(lines))
    (logs / "summary.txt").write_text("\n".join(lines) + "\n")

    # Locally a cell whose database or tool is missing is reported, not failed;
    # in CI (IDEMPOTENCY_REQUIRE_SERVICES=1) every cell must run and pass.
    def excused(cell: Cell) -> bool:
        return not required and (cell.problem or "").startswith("not run")

    return 0 if all(cell.ok or excused(cell) for cell in cells) else 1
