"""The server passes leave the tests that reach no database to the SQLite pass.

A file of example tests is collected by a real pytest process with the
suite's settings and the selection plugin (``tests/selection.py``), with
and without ``--database-tests-only``; what each keeps is read from
``--collect-only``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import runtests
from tests.configurations import CONFIGURATIONS
from tests.configurations.matrix import Cell, leave_database_independent_tests_to_one_cell

REPO_ROOT = Path(__file__).resolve().parents[1]

EXAMPLES = """
import subprocess

import pytest
from django.test import SimpleTestCase, TestCase


def test_pure():
    assert sorted([2, 1]) == [1, 2]


def test_db_fixture(db):
    pass


@pytest.mark.django_db
def test_django_db_marker():
    pass


@pytest.fixture
def records(transactional_db):
    return []


@pytest.fixture
def nested(records):
    return records


def test_database_fixture_two_fixtures_away(nested):
    pass


@pytest.fixture(scope="module")
def loaded(django_db_blocker):
    with django_db_blocker.unblock():
        yield


def test_module_fixture_that_unblocks_the_database(loaded):
    pass


@pytest.fixture
def asks_later(request):
    request.getfixturevalue("db")


def test_fixture_asking_for_the_database_at_run_time(asks_later):
    pass


@pytest.fixture
def plain_value():
    return 1


def test_fixture_without_a_database(plain_value):
    assert plain_value == 1


@pytest.mark.database
def test_another_process_reaches_the_database():
    subprocess.run(["true"], check=True)


@pytest.mark.live
def test_live():
    pass


@pytest.mark.postgres
def test_postgres():
    pass


@pytest.mark.skipif(False, reason="the SQLite pass may be where it skips")
def test_conditionally_skipped():
    pass


def test_compares_engines():
    from django.db import connection

    assert connection.vendor


def test_counts_queries(django_assert_num_queries):
    pass


class TestWithTheDatabase(TestCase):
    def test_in_a_test_case(self):
        pass


class TestWithoutTheDatabase(SimpleTestCase):
    def test_in_a_simple_test_case(self):
        pass
"""

DATABASE_INDEPENDENT = {
    "test_pure",
    "test_fixture_without_a_database",
    "TestWithoutTheDatabase::test_in_a_simple_test_case",
}
EVERY_TEST = DATABASE_INDEPENDENT | {
    "test_db_fixture",
    "test_django_db_marker",
    "test_database_fixture_two_fixtures_away",
    "test_module_fixture_that_unblocks_the_database",
    "test_fixture_asking_for_the_database_at_run_time",
    "test_another_process_reaches_the_database",
    "test_live",
    "test_postgres",
    "test_conditionally_skipped",
    "test_compares_engines",
    "test_counts_queries",
    "TestWithTheDatabase::test_in_a_test_case",
}


def pytest_process(
    path: Path, *options: str, environment: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """pytest on ``path`` with the suite's settings and the selection plugin, on SQLite."""
    return subprocess.run(
        [
            sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
            "-c", str(REPO_ROOT / "pyproject.toml"), "--rootdir", str(REPO_ROOT),
            "-p", "tests.selection", *options, str(path),
        ],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "DATABASE_URL": "", **(environment or {})},
    )  # fmt: skip


def collect(tmp_path: Path, *options: str) -> tuple[set[str], str]:
    """The tests a pytest process keeps from EXAMPLES, and its output."""
    examples = tmp_path / "test_examples.py"
    examples.write_text(textwrap.dedent(EXAMPLES))
    result = pytest_process(examples, "--collect-only", *options)
    assert result.returncode == 0, result.stdout + result.stderr
    # Node ids are printed relative to the rootdir: "::test_pure" for a file outside it.
    kept = {line.split("::", 1)[1] for line in result.stdout.splitlines() if "::" in line}
    return kept, result.stdout


def test_a_server_pass_deselects_only_the_tests_that_reach_no_database(tmp_path: Path) -> None:
    kept, output = collect(tmp_path, "--database-tests-only")
    assert kept == EVERY_TEST - DATABASE_INDEPENDENT
    assert (
        f"--database-tests-only: {len(DATABASE_INDEPENDENT)} database-independent tests "
        "deselected" in output
    )


def test_without_the_option_every_test_is_kept(tmp_path: Path) -> None:
    kept, output = collect(tmp_path)
    assert kept == EVERY_TEST
    assert "database-independent" not in output


def test_only_the_server_passes_of_runtests_deselect() -> None:
    sqlite = runtests._pass_command(["-x"], coverage=True, server=False)
    server = runtests._pass_command(["-x"], coverage=True, server=True)
    assert "--database-tests-only" not in sqlite
    assert server == [*sqlite[:-1], "--database-tests-only", "-x"]


def test_each_configuration_runs_every_test_in_its_first_cell_only() -> None:
    cells = [
        Cell(CONFIGURATIONS["fail-open"], "sqlite"),
        Cell(CONFIGURATIONS["fail-open"], "postgres"),
        Cell(CONFIGURATIONS["fail-open"], "mariadb"),
        Cell(CONFIGURATIONS["repeatable-read"], "postgres"),
        Cell(CONFIGURATIONS["repeatable-read"], "mariadb"),
    ]
    leave_database_independent_tests_to_one_cell(cells)
    assert [cell.every_test for cell in cells] == [True, False, False, True, False]


SKIPS_ITSELF = """
import pytest


def test_runs():
    pass


def test_skips_itself():
    pytest.skip("promtool is not installed")
"""


def test_a_database_independent_test_that_skips_on_sqlite_fails_ci(tmp_path: Path) -> None:
    """The SQLite pass is the only one that runs it: skipped there, it proved nothing."""
    examples = tmp_path / "test_skipping.py"
    examples.write_text(SKIPS_ITSELF)
    ci = pytest_process(examples, environment={"IDEMPOTENCY_REQUIRE_SERVICES": "1"})
    assert ci.returncode == 1, ci.stdout + ci.stderr
    assert "1 database-independent test(s) skipped in the SQLite pass" in ci.stdout
    assert "::test_skips_itself" in ci.stdout.split("skipped in the SQLite pass")[1]
    local = pytest_process(examples, environment={"IDEMPOTENCY_REQUIRE_SERVICES": "0"})
    assert local.returncode == 0, local.stdout + local.stderr
