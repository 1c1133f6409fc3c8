from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.live.server import LazyLiveServer


@pytest.fixture(scope="module")
def live() -> Iterator[LazyLiveServer]:
    """One database and gunicorn per test module, started by the first ``live.get()``.

    Starting it lazily, inside the test, lets ``require_postgres()`` skip the
    test (or fail it, in CI) rather than error its setup.
    """
    lazy = LazyLiveServer()
    try:
        yield lazy
    finally:
        lazy.close()
