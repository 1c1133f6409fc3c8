"""Debian's Chromium driven by Playwright for Python, for the admin's browser tests.

Playwright's own browser downloads are not used: ``launch()`` starts the
system's Chromium (``/usr/bin/chromium``, from Debian's ``chromium``
package; another binary with ``IDEMPOTENCY_CHROMIUM``).

Locally a missing Chromium (or Playwright) skips the test with a clear
reason. In CI, which sets ``IDEMPOTENCY_REQUIRE_SERVICES=1``, it fails
instead, the same policy as PostgreSQL's in ``tests.live.services``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.live.services import REQUIRE_SERVICES_ENV, services_required

CHROMIUM_ENV = "IDEMPOTENCY_CHROMIUM"
DEFAULT_CHROMIUM = "/usr/bin/chromium"
#: No sandbox (CI runs as root), no GPU, and nothing that talks to the outside.
LAUNCH_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]


def chromium_path() -> str:
    return os.environ.get(CHROMIUM_ENV) or DEFAULT_CHROMIUM


def _unavailable(reason: str) -> None:
    if services_required():
        pytest.fail(
            f"Chromium is required ({REQUIRE_SERVICES_ENV}=1) but unavailable: {reason}",
            pytrace=False,
        )
    pytest.skip(
        f"Chromium unavailable ({reason}); install Debian's chromium package (or set "
        f"{CHROMIUM_ENV}), or set {REQUIRE_SERVICES_ENV}=1 to make this a failure"
    )


def require_chromium() -> str:
    """The Chromium binary, if it and Playwright are installed; else skip or fail the test."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError as exc:
        _unavailable(f"Playwright for Python is not installed: {exc}")
    path = chromium_path()
    found = shutil.which(path)
    if found is None or not Path(found).is_file():
        _unavailable(f"no executable at {path}")
        raise AssertionError("unreachable")  # skip/fail raise
    return found


@contextlib.contextmanager
def chromium() -> Iterator[Any]:
    """A headless Chromium (a Playwright ``Browser``); skips or fails when absent."""
    executable = require_chromium()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=executable, headless=True, args=LAUNCH_ARGS
        )
        try:
            yield browser
        finally:
            browser.close()
