from __future__ import annotations

import itertools
import os
import uuid
from collections.abc import Callable, Iterator

import pytest
from django.db import connections
from hypothesis import settings as hypothesis_settings
from rest_framework.test import APIClient

from tests.factories import TokenFactory
from tests.utils import TokenClient


@pytest.fixture
def client_for() -> Callable[..., TokenClient]:
    """An API client authenticated with a fresh token (a tenant of its own)."""

    def make(**credentials: str) -> TokenClient:
        return TokenClient(TokenFactory.create(), **credentials)

    return make


@pytest.fixture
def api(db: None) -> APIClient:
    return APIClient()


@pytest.fixture
def new_key() -> Callable[[], str]:
    counter = itertools.count()
    run = uuid.uuid4().hex[:8]
    return lambda: f"key-{run}-{next(counter)}"


@pytest.fixture
def atomic_requests() -> Iterator[None]:
    """Turn on ATOMIC_REQUESTS for the default database for one test."""
    settings_dict = connections["default"].settings_dict
    settings_dict["ATOMIC_REQUESTS"] = True
    try:
        yield
    finally:
        settings_dict["ATOMIC_REQUESTS"] = False


@pytest.fixture(scope="session")
def django_db_modify_db_settings(django_db_modify_db_settings_parallel_suffix: None) -> None:
    """The test process's PostgreSQL sessions commit without waiting for the WAL flush.

    ``synchronous_commit=off`` spares every commit of the suite the wait for
    the disk (1-2 ms here, tens of thousands of commits in a PostgreSQL pass,
    migrations included). A commit is as visible to other sessions as before,
    and nothing the tests do loses it: they kill Python processes, never the
    server, which only ``pg_ctl stop -m immediate`` in tests/live and
    tests/fleet would do, on clusters of their own. Only this process's
    connections, set here (not in tests/settings.py): the processes those
    tests start load the settings too, and a failover test needs its
    server's ``synchronous_commit = on``.
    """
    for alias in connections:
        settings_dict = connections[alias].settings_dict
        if connections[alias].vendor == "postgresql":
            options = settings_dict.setdefault("OPTIONS", {})
            options["options"] = f"{options.get('options', '')} -c synchronous_commit=off".strip()


# --- PostgreSQL tests and the CI policy ------------------------------------
#
# The suite runs three times (runtests.py): on SQLite (the default), then
# with DATABASE_URL pointing at PostgreSQL and at MariaDB. Tests marked
# ``postgres`` run in the PostgreSQL pass only; the tests that reach no
# database in the SQLite pass only (tests/selection.py). With
# IDEMPOTENCY_REQUIRE_SERVICES=1 (CI), a PostgreSQL pass in which a
# PostgreSQL test was skipped fails: a proof that silently skipped proves
# nothing. (Service-backed tests also fail themselves, in require_postgres().)

REQUIRE_SERVICES = os.environ.get("IDEMPOTENCY_REQUIRE_SERVICES") == "1"

hypothesis_settings.register_profile("ci", derandomize=True, deadline=None)
hypothesis_settings.register_profile("dev", deadline=None)
hypothesis_settings.load_profile("ci" if REQUIRE_SERVICES else "dev")


def _suite_database_is_postgresql() -> bool:
    return bool(connections["default"].vendor == "postgresql")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _deselect_fleet_tests_unless_asked(config, items)
    if _suite_database_is_postgresql():
        return
    skip = pytest.mark.skip(reason="runs in the PostgreSQL pass (DATABASE_URL=postgres://...)")
    for item in items:
        if item.get_closest_marker("postgres"):
            item.add_marker(skip)


def _deselect_fleet_tests_unless_asked(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The fleet tests run in ``make fleet`` (``-m fleet``), never in the three passes.

    They build hosts of their own (network namespaces, a load balancer, their
    own PostgreSQL), whatever the pass's database is: three passes would run
    the same minutes three times. Deselected, not skipped, so that the CI
    policy on skipped PostgreSQL tests does not count them.
    """
    if "fleet" in (config.option.markexpr or ""):
        return
    fleet = [item for item in items if item.get_closest_marker("fleet")]
    if fleet:
        config.hook.pytest_deselected(items=fleet)
        items[:] = [item for item in items if not item.get_closest_marker("fleet")]


_skipped: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and "postgres" in report.keywords:
        _skipped.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if REQUIRE_SERVICES and _suite_database_is_postgresql() and _skipped:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(
                f"IDEMPOTENCY_REQUIRE_SERVICES=1: {len(_skipped)} PostgreSQL test(s) skipped "
                "in the PostgreSQL pass; every one must run:",
                red=True,
            )
            for nodeid in _skipped:
                reporter.write_line(f"  {nodeid}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
