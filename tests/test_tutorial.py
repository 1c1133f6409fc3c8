"""The tutorial (docs/tutorial.md), followed the way a reader follows it.

In an empty temporary directory the test types the tutorial into one bash
session, in the page's order (tests/live/pages.py): each shell block is run
as shown (only the lines that make a virtualenv and install the package are
left out: the test's interpreter already has it), each code block with a
file name (``title="payments/views.py"``; ``"... (add at the end)"`` for
additions) is written to that file, and ``manage.py runserver`` is started
in the background and restarted after a file changed, as its autoreloader
would. Then every response and every command output the page shows is
compared with what the server and the commands really answered.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from tests.live.pages import (
    Expected,
    assert_answers_as_shown,
    follow_page,
    page_blocks,
    parse_exchange,
    session_script,
)

pytestmark = pytest.mark.live

REPO_ROOT = Path(__file__).resolve().parent.parent
TUTORIAL = REPO_ROOT / "docs" / "tutorial.md"
#: How long the whole tutorial may take: it takes 15 to 40 s on 2 busy cores.
TIMEOUT = 120


@pytest.fixture(scope="module")
def tutorial(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Expected]]:
    workdir = tmp_path_factory.mktemp("tutorial")
    return workdir, follow_page(TUTORIAL, workdir, timeout=TIMEOUT)


def test_tutorial_blocks_carry_file_names_and_answers() -> None:
    blocks = page_blocks(TUTORIAL.read_text())
    written = {block.path for block in blocks if block.path is not None}
    # Every file a reader writes or changes, after startproject and startapp.
    assert written == {
        "shop/settings.py",
        "shop/urls.py",
        "payments/models.py",
        "payments/serializers.py",
        "payments/views.py",
        "payments/urls.py",
        "payments/provider.py",
        "payments/reconcilers.py",
        "payments/apps.py",
    }
    _, expected = session_script(blocks, Path("/nonexistent"), 8000)
    assert [item.kind for item in expected].count("http") >= 9


def test_every_answer_the_tutorial_shows_is_the_servers(
    tutorial: tuple[Path, list[Expected]],
) -> None:
    _, expected = tutorial
    assert_answers_as_shown(expected)


def test_the_reconciler_stores_the_bytes_the_view_answers(
    tutorial: tuple[Path, list[Expected]],
) -> None:
    _, expected = tutorial
    exchanges = [
        parse_exchange(item.output.read_bytes()) for item in expected if item.kind == "http"
    ]
    # The view's own 201 (step 6), the reconciled replay (step 8), and the
    # API's answer about the reconciled payment.
    created = next(
        e for e in exchanges if e.status_line.endswith("201 Created") and b"ch_1" in e.body
    )
    settled = next(
        e
        for e in exchanges
        if e.headers.get("idempotency-key") == "3e8a5b61-order-1003"
        and e.status_line.endswith("201 Created")
    )
    retrieved = next(e for e in exchanges if e.status_line.endswith("200 OK"))
    assert settled.headers["idempotent-replayed"] == "true"
    assert settled.body == retrieved.body
    assert settled.headers["content-type"] == created.headers["content-type"]
    assert settled.headers["location"] == "/api/payments/3/"
    # The view's bytes and the reconciler's come from one serializer: the
    # same fields in the same order, the same separators.
    assert list(_json_keys(settled.body)) == list(_json_keys(created.body))


def test_the_lost_answer_was_charged_once(tutorial: tuple[Path, list[Expected]]) -> None:
    workdir, _ = tutorial
    ledger = sqlite3.connect(workdir / "project" / "shop" / "provider-ledger.sqlite3")
    try:
        charges = ledger.execute("SELECT number, amount FROM charge ORDER BY number").fetchall()
    finally:
        ledger.close()
    # ORD-1002's charge and ORD-1003's, however often ORD-1003 was retried.
    assert charges == [(1, 990), (2, 1999)]


def _json_keys(body: bytes) -> list[str]:
    return list(json.loads(body))
