"""docs/middleware.md, followed as a reader follows it: a project made, keys rolled out.

The page is written as the tutorial is (files with a title, shell blocks,
``curl -i`` exchanges, console outputs), so the tutorial's harness
(``tests/test_tutorial.py``) types it into one bash session in an empty
directory and compares every answer the page shows with the server's:
report-only (a keyless request served, its log line, its metric), keyed
requests protected, keys required, and ``idempotency_routes``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from django.db import connections

from tests.live.services import services_required
from tests.test_tutorial import (
    REPO_ROOT,
    Expected,
    assert_answers_as_shown,
    follow,
    session_script,
    tutorial_blocks,
)

pytestmark = pytest.mark.live

PAGE = REPO_ROOT / "docs" / "middleware.md"


@pytest.fixture(scope="module")
def followed(tmp_path_factory: pytest.TempPathFactory) -> list[Expected]:
    if connections["default"].vendor != "sqlite":
        pytest.skip("runs in the SQLite pass (the page's project brings its own database)")
    if shutil.which("curl") is None:
        reason = "the page's requests are made with curl, which is not installed"
        if services_required():
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    workdir = tmp_path_factory.mktemp("middleware-page")
    expected, completed = follow(PAGE, workdir)
    log = workdir / "answers" / "runserver.log"
    assert completed.returncode == 0, (
        f"the page's session failed:\n{completed.stdout}\n"
        f"runserver:\n{log.read_text() if log.exists() else ''}"
    )
    return expected


def test_the_page_writes_its_files_and_shows_its_answers() -> None:
    blocks = tutorial_blocks(PAGE.read_text())
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
