"""docs/adrf.md, followed the way a reader follows it, under a real ASGI server.

In an empty temporary directory the test types the page into one bash
session, in its order, as tests/live/pages.py does with the tutorial:
each shell block is run as shown (the lines that make a virtualenv and
install the package left out: the test's interpreter has it), each code
block with a file name is written to that file, and ``uvicorn
shop.asgi:application`` is started in the background on a free port.
Nothing of the repository is importable there but the installed packages:
the example works from the wheel. Then every response the page shows is
compared with what uvicorn answered. The page's own async test, last,
runs under pytest in that project, on PostgreSQL.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import dj_database_url
import pytest
from django.db import connections

from tests.live.pages import (
    ENVIRONMENT_SETUP,
    PAGE_ADDRESS,
    Block,
    Expected,
    page_blocks,
    parse_exchange,
)
from tests.live.server import free_port, terminate
from tests.live.services import require_postgres, services_required

pytestmark = pytest.mark.live

REPO_ROOT = Path(__file__).resolve().parent.parent
PAGE = REPO_ROOT / "docs" / "adrf.md"
SERVE = "uvicorn shop.asgi:application"
#: How long the whole page may take: about 10 s on 2 busy cores.
TIMEOUT = 120

PRELUDE = """\
set -euo pipefail
SERVER=""
start_server() {
    uvicorn shop.asgi:application --port "$PORT" --log-level warning \
        >>"$OUT/uvicorn.log" 2>&1 &
    SERVER=$!
    for _ in $(seq 300); do
        curl -s -o /dev/null "http://127.0.0.1:$PORT/api/" && return 0
        sleep 0.1
    done
    echo "uvicorn did not answer on port $PORT" >&2
    return 1
}
stop_server() {
    if [ -n "$SERVER" ]; then kill "$SERVER"; wait "$SERVER" || true; SERVER=""; fi
}
trap stop_server EXIT
"""


def session_script(blocks: list[Block], out: Path, port: int) -> tuple[str, list[Expected]]:
    """The bash session that follows the page, and the answers it must get."""
    lines = [PRELUDE]
    expected: list[Expected] = []
    for index, block in enumerate(blocks):
        following = blocks[index + 1] if index + 1 < len(blocks) else None
        if block.path is not None:
            redirect = ">>" if block.append else ">"
            lines.append(f"cat {redirect} {shlex.quote(block.path)} <<'PAGE_FILE_END'")
            lines.append(("\n" if block.append else "") + block.body.rstrip("\n"))
            lines.append("PAGE_FILE_END")
        elif block.lang == "sh" and "curl " in block.body:
            assert following is not None and following.lang == "http", (
                f"the page shows no answer for:\n{block.body}"
            )
            output = out / f"answer-{len(expected)}.txt"
            command = block.body.replace(PAGE_ADDRESS, f"127.0.0.1:{port}")
            lines.append(f"{{\n{command}\n}} > {shlex.quote(str(output))}")
            expected.append(Expected("http", following.body, output))
        elif block.lang == "sh":
            for line in block.body.splitlines():
                if not line.startswith(ENVIRONMENT_SETUP):
                    lines.append("start_server" if line.strip() == SERVE else line)
    return "\n".join(lines) + "\n", expected


@pytest.fixture(scope="module")
def followed(page_session: tuple[Path, list[Expected]]) -> list[Expected]:
    return page_session[1]


@pytest.fixture(scope="module")
def page_session(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Expected]]:
    """The project the page built (its server stopped), and the answers it must have got."""
    if connections["default"].vendor != "sqlite":
        pytest.skip("runs in the SQLite pass (the page's project brings its own database)")
    if shutil.which("curl") is None:
        reason = "the page's requests are made with curl, which is not installed"
        if services_required():
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    workdir = tmp_path_factory.mktemp("adrf-page")
    out, project = workdir / "answers", workdir / "project"
    out.mkdir()
    project.mkdir()
    port = free_port()
    script, expected = session_script(page_blocks(PAGE.read_text()), out, port)
    (workdir / "page.sh").write_text(script)
    env = readers_environment()
    env.update(PORT=str(port), OUT=str(out))
    process = subprocess.Popen(
        ["bash", str(workdir / "page.sh")],
        cwd=project,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its uvicorn goes with it if the test gives up
    )
    try:
        stdout, _ = process.communicate(timeout=TIMEOUT)
    finally:
        if process.poll() is None:
            terminate(process)
    log = out / "uvicorn.log"
    served = log.read_text() if log.exists() else ""
    assert process.returncode == 0, f"the page's session failed:\n{stdout}\nuvicorn:\n{served}"
    return project, expected


def readers_environment() -> dict[str, str]:
    env = {
        name: value
        for name, value in os.environ.items()
        # The test suite's settings and checkout must not leak into the reader's project.
        if name not in ("DJANGO_SETTINGS_MODULE", "DATABASE_URL", "PYTHONPATH")
    }
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def test_the_page_writes_its_files_and_shows_an_answer_for_each_request() -> None:
    blocks = page_blocks(PAGE.read_text())
    written = {block.path for block in blocks if block.path is not None}
    assert written == {"shop/settings.py", "orders/models.py", "orders/views.py", "shop/urls.py"}
    _, expected = session_script(blocks, Path("/nonexistent"), 8000)
    assert len(expected) == 7


def test_every_answer_the_page_shows_is_uvicorns(followed: list[Expected]) -> None:
    for item in followed:
        shown = parse_exchange(item.shown.encode())
        got = parse_exchange(item.output.read_bytes())
        assert got.status_line == shown.status_line, (item.shown, got)
        for name, value in shown.headers.items():
            assert got.headers.get(name) == value, (name, item.shown, got)
        assert got.body == shown.body.rstrip(b"\n"), (item.shown, got)


def test_the_pages_async_test_passes_under_pytest_on_postgresql(
    page_session: tuple[Path, list[Expected]],
) -> None:
    """The test of "Testing your async views", in the page's project, configured as it says."""
    project = page_session[0] / "shop"  # the page's `django-admin startproject shop; cd shop`
    blocks = page_blocks(PAGE.read_text())
    (test,) = [block for block in blocks if "simulate_crash_after_begin_external()" in block.body]
    database = dj_database_url.parse(require_postgres())
    # A name of its own: pytest-django makes and drops test_<NAME> on that server.
    database["NAME"] = f"adrf_page_{os.getpid()}"
    (project / "shop" / "settings_postgres.py").write_text(
        f"from shop.settings import *  # noqa: F403\n\nDATABASES = {{'default': {database!r}}}\n"
    )
    (project / "pytest.ini").write_text(
        "[pytest]\nDJANGO_SETTINGS_MODULE = shop.settings_postgres\nasyncio_mode = auto\n"
        "asyncio_default_fixture_loop_scope = function\n"
    )
    (project / "orders" / "test_refund.py").write_text(test.body)

    try:
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "orders/test_refund.py"],
            cwd=project,
            env=readers_environment(),
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
    finally:
        drop_database(f"test_{database['NAME']}")

    assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout + run.stderr
    # A connection left open in asgiref's thread keeps the test database from being dropped.
    assert "Error when trying to teardown" not in run.stdout, run.stdout


def drop_database(name: str) -> None:
    """Drop what a failed run could not (its connection still open), so none is left behind."""
    import psycopg
    from psycopg import sql

    with psycopg.connect(require_postgres(), autocommit=True) as server:
        server.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )
