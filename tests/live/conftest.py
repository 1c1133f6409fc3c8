from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.live.processes import PaymentsStack, lazy_payments_stack, summary_lines
from tests.live.server import Lazy, LiveServer, lazy_live_server


@pytest.fixture(scope="module")
def live() -> Iterator[Lazy[LiveServer]]:
    """One database and gunicorn per test module, started by the first ``live.get()``.

    Starting it lazily, inside the test, lets ``require_postgres()`` skip the
    test (or fail it, in CI) rather than error its setup.
    """
    lazy = lazy_live_server()
    try:
        yield lazy
    finally:
        lazy.close()


@pytest.fixture(scope="module")
def payments() -> Iterator[Lazy[PaymentsStack]]:
    """The demo project's payments API with its provider and a Celery worker.

    One stack per test module (``tests.live.processes.payments_stack``),
    started by the first ``payments.get()`` inside a test.
    """
    lazy = lazy_payments_stack()
    try:
        yield lazy
    finally:
        lazy.close()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if summary_lines:
        terminalreporter.section("live tests: results")
        for line in summary_lines:
            terminalreporter.write_line(line)
