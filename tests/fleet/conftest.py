from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.fleet.hosts import Fleet, fleet, require_fleet
from tests.live.server import Lazy

#: Lines printed in pytest's terminal summary (the figures tables), visible without ``-s``.
summary_lines: list[str] = []


@pytest.fixture(scope="session")
def the_fleet() -> Iterator[Lazy[Fleet]]:
    """One fleet for the session, started by the first ``get()`` inside a test.

    Started lazily so that a machine without namespaces or nginx skips the
    test (fails it under IDEMPOTENCY_REQUIRE_SERVICES=1) instead of erroring
    its setup.
    """
    lazy = Lazy(fleet, require_fleet)
    try:
        yield lazy
    finally:
        lazy.close()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if summary_lines:
        terminalreporter.section("fleet tests: figures")
        for line in summary_lines:
            terminalreporter.write_line(line)
