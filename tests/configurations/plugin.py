"""pytest markers for the configuration matrix (loaded with ``-p`` from pyproject.toml).

``@pytest.mark.not_under("name", reason="...")``: the test checks a behaviour
the configuration ``name`` changes on purpose (a 503 under ``fail-open``, a
query count under ``atomic-requests``); skipped in that configuration only,
with the reason. ``@pytest.mark.only_under("name", ...)``: the test is about
those configurations and skipped in the others.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import Phase, settings

from tests import configurations

UNDER = "under the configuration "
ONLY_UNDER = "only under the configuration(s) "

# The cells' profile (runtests.py --configurations passes it): CI's, without
# shrinking. A state machine failing under a configuration is reported with
# the example found; shrinking it took minutes per test.
settings.register_profile(
    "matrix",
    derandomize=True,
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target],
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "not_under(*names, reason, databases=None): skipped under these configurations "
        "(on these databases), which change on purpose the behaviour the test checks",
    )
    config.addinivalue_line("markers", "only_under(*names): runs only under these configurations")


def _database() -> str:
    """The suite's database as the matrix names it: sqlite, postgres or mariadb."""
    from django.conf import settings as django_settings

    engine = django_settings.DATABASES["default"]["ENGINE"]
    return {"postgresql": "postgres", "mysql": "mariadb"}.get(engine.rsplit(".", 1)[-1], "sqlite")


def pytest_report_header(config: pytest.Config) -> str:
    return f"idempotency test configuration: {configurations.active()}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    name = configurations.active()
    for item in items:
        for marker in item.iter_markers("not_under"):
            databases = marker.kwargs.get("databases")
            if name in marker.args and (databases is None or _database() in databases):
                reason = marker.kwargs.get("reason")
                assert reason, f"{item.nodeid}: not_under() needs a reason"
                item.add_marker(pytest.mark.skip(reason=f"{UNDER}{name}: {reason}"))
        only = item.get_closest_marker("only_under")
        if only is not None and name not in only.args:
            item.add_marker(pytest.mark.skip(reason=f"{ONLY_UNDER}{', '.join(only.args)}"))
        if name == "read-replica-router":
            # The replica alias is part of the project: tests may use it.
            database = item.get_closest_marker("django_db")
            if database is not None:
                item.add_marker(
                    pytest.mark.django_db(**{**database.kwargs, "databases": "__all__"}),
                    append=False,
                )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome: Any = yield
    report = outcome.get_result()
    reason = report.longrepr[2] if report.skipped and isinstance(report.longrepr, tuple) else ""
    if reason.startswith((f"Skipped: {UNDER}", f"Skipped: {ONLY_UNDER}")):
        # A skip chosen by the configuration, not a missing PostgreSQL: keep it
        # out of the CI policy that fails a PostgreSQL pass with skipped
        # PostgreSQL tests (tests/conftest.py).
        report.keywords = {
            name: value for name, value in report.keywords.items() if name != "postgres"
        }


@pytest.fixture(autouse=True)
def _configuration_stays_applied() -> None:
    """Put back what a test fixture reset to the suite's default.

    ``tests.conftest.atomic_requests`` turns ATOMIC_REQUESTS off after its
    test; under the ``atomic-requests`` configuration every test must run
    with it on.
    """
    if configurations.active() == "atomic-requests":
        from django.db import connections

        connections["default"].settings_dict["ATOMIC_REQUESTS"] = True
