"""docs/ninja.md, followed in a fresh directory the way a reader follows it (tests/live/pages.py).

Only the package's public import paths are used there: the page's project
is made with ``startproject`` and holds nothing of this repository.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from tests.live.pages import Expected, assert_answers_as_shown, follow_page, page_blocks

pytestmark = pytest.mark.live

PAGE = Path(__file__).resolve().parent.parent / "docs" / "ninja.md"
#: How long following the page may take: about 10 s on 2 busy cores.
TIMEOUT = 90


@pytest.fixture(scope="module")
def followed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Expected]]:
    workdir = tmp_path_factory.mktemp("ninja-page")
    return workdir, follow_page(PAGE, workdir, timeout=TIMEOUT)


def test_the_page_writes_a_project_and_shows_its_answers() -> None:
    blocks = page_blocks(PAGE.read_text())

    assert {block.path for block in blocks if block.path} == {
        "shop/settings.py",
        "orders/models.py",
        "orders/api.py",
        "shop/urls.py",
    }
    assert sum(1 for block in blocks if block.lang == "http") >= 5


def test_every_answer_the_page_shows_is_the_servers(followed: tuple[Path, list[Expected]]) -> None:
    _, expected = followed
    assert_answers_as_shown(expected)


def test_the_retried_order_was_made_once_and_its_api_key_is_stored_nowhere(
    followed: tuple[Path, list[Expected]],
) -> None:
    workdir, _ = followed
    database = sqlite3.connect(workdir / "project" / "shop" / "db.sqlite3")
    try:
        orders = database.execute("SELECT customer, amount FROM orders_order").fetchall()
        records = database.execute("SELECT * FROM django_idempotency_record").fetchall()
    finally:
        database.close()
    assert orders == [("acme", 4200)]
    assert len(records) == 1
    assert "acme-live-4f0c9a7e2b" not in repr(records)
