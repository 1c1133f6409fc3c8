"""docs/middleware.md, followed as a reader follows it: a project made, keys rolled out.

The page is written as the tutorial is (files with a title, shell blocks,
``curl -i`` exchanges, console outputs), so the harness that follows
the tutorial (``tests/live/pages.py``) types it into one bash session in an empty
directory and compares every answer the page shows with the server's:
report-only (a keyless request served, its log line, its metric), keyed
requests protected, keys required, and ``idempotency_routes``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.live.pages import (
    REPO_ROOT,
    Expected,
    assert_answers_as_shown,
    follow_page,
    page_blocks,
    session_script,
)

pytestmark = pytest.mark.live

PAGE = REPO_ROOT / "docs" / "middleware.md"
#: How long following the page may take.
TIMEOUT = 120


@pytest.fixture(scope="module")
def followed(tmp_path_factory: pytest.TempPathFactory) -> list[Expected]:
    workdir = tmp_path_factory.mktemp("middleware-page")
    return follow_page(PAGE, workdir, timeout=TIMEOUT)


def test_the_page_writes_its_files_and_shows_its_answers() -> None:
    blocks = page_blocks(PAGE.read_text())
    written = {block.path for block in blocks if block.path is not None}
    assert written == {
        "shop/settings.py",
        "orders/models.py",
        "orders/views.py",
        "orders/urls.py",
        "shop/urls.py",
    }
    _, expected = session_script(blocks, Path("/nonexistent"), 8000)
    assert [item.kind for item in expected].count("http") == 7
    assert [item.kind for item in expected].count("console") == 3


def test_every_answer_the_page_shows_is_the_servers(followed: list[Expected]) -> None:
    assert_answers_as_shown(followed)
