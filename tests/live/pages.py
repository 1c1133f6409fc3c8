"""A documentation page followed the way a reader follows it, in a fresh directory.

In an empty temporary directory the page is typed into one bash session, in
its order: each shell block is run as shown (only the lines that make a
virtualenv and install the package are left out: the test's interpreter
already has it), each code block with a file name
(``title="payments/views.py"``; ``"... (add at the end)"`` for additions)
is written to that file, and ``manage.py runserver`` is started in the
background and restarted after a file changed, as its autoreloader would.
The test then compares every response and every command output the page
shows with what the server and the commands really answered
(tests/test_tutorial.py, tests/test_ninja_page.py).
"""

from __future__ import annotations

import email.parser
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from django.db import connections

from tests.live.server import free_port, terminate
from tests.live.services import services_required

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
#: The lines a reader runs to get a virtualenv with the package: the test's
#: interpreter has it already (this checkout of it, through PYTHONPATH).
ENVIRONMENT_SETUP = ("python -m venv ", "source ", "pip install ")
RUNSERVER = "python manage.py runserver"
#: The address the page's curl commands use: runserver's default.
PAGE_ADDRESS = "127.0.0.1:8000"
_FENCE = re.compile(r"^```(?P<lang>[\w-]*)(?P<attrs>[^\n]*)\n(?P<body>.*?)^```[ \t]*$", re.M | re.S)
_TITLE = re.compile(r'title="(?P<path>[^" ]+)(?P<append> \(add at the end\))?"')


@dataclass(frozen=True)
class Block:
    lang: str
    body: str
    path: str | None = None
    append: bool = False


def page_blocks(text: str) -> list[Block]:
    blocks = []
    for match in _FENCE.finditer(text):
        title = _TITLE.search(match["attrs"])
        blocks.append(
            Block(
                lang=match["lang"],
                body=match["body"],
                path=title["path"] if title else None,
                append=bool(title and title["append"]),
            )
        )
    return blocks


@dataclass(frozen=True)
class Expected:
    """What the page shows a command answering, and the file its real answer went to."""

    kind: str  # "http": a curl -i exchange; "console": a command's output
    shown: str
    output: Path


# The session's helpers. runserver runs without its autoreloader (whose
# child process would outlive a kill of the parent); a changed file
# restarts it before the next request instead.
PRELUDE = """\
set -euo pipefail
SERVER=""
start_server() {
    python manage.py runserver "127.0.0.1:$PORT" --noreload >>"$OUT/runserver.log" 2>&1 &
    SERVER=$!
    for _ in $(seq 300); do
        curl -s -o /dev/null "http://127.0.0.1:$PORT/admin/login/" && return 0
        sleep 0.1
    done
    echo "runserver did not answer on port $PORT" >&2
    return 1
}
stop_server() {
    if [ -n "$SERVER" ]; then kill "$SERVER"; wait "$SERVER" || true; SERVER=""; fi
}
CHANGED=""
fresh_server() {
    if [ -n "$SERVER" ] && [ -n "$CHANGED" ]; then stop_server; start_server; fi
    CHANGED=""
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
            # A quoted here-document: the file's text exactly as shown.
            redirect = ">>" if block.append else ">"
            lines.append(f"cat {redirect} {shlex.quote(block.path)} <<'PAGE_FILE_END'")
            lines.append(("\n" if block.append else "") + block.body.rstrip("\n"))
            lines.append("PAGE_FILE_END")
            lines.append('CHANGED="yes"')
        elif block.lang == "sh" and "curl " in block.body:
            assert following is not None and following.lang == "http", (
                f"the page shows no answer for:\n{block.body}"
            )
            output = out / f"answer-{len(expected)}.txt"
            command = block.body.replace(PAGE_ADDRESS, f"127.0.0.1:{port}")
            lines.append(f"fresh_server\n{{\n{command}\n}} > {shlex.quote(str(output))}")
            expected.append(Expected("http", following.body, output))
        elif block.lang == "sh":
            for line in block.body.splitlines():
                if line.startswith(ENVIRONMENT_SETUP):
                    continue
                lines.append("start_server" if line.strip() == RUNSERVER else line)
        elif block.lang == "console":
            commands = [
                line[2:].replace(PAGE_ADDRESS, f"127.0.0.1:{port}")
                for line in block.body.splitlines()
                if line.startswith("$ ")
            ]
            shown = "".join(
                line + "\n" for line in block.body.splitlines() if not line.startswith("$ ")
            )
            output = out / f"output-{len(expected)}.txt"
            lines.append(f"{{\n{chr(10).join(commands)}\n}} > {shlex.quote(str(output))}")
            expected.append(Expected("console", shown, output))
    return "\n".join(lines) + "\n", expected


@dataclass(frozen=True)
class Exchange:
    status_line: str
    headers: dict[str, str]
    body: bytes


def parse_exchange(raw: bytes) -> Exchange:
    """A response as ``curl -i`` prints it, or as the page shows one."""
    raw = raw.replace(b"\r\n", b"\n")
    head, _, body = raw.partition(b"\n\n")
    status_line, _, header_lines = head.decode("latin-1").partition("\n")
    message = email.parser.HeaderParser().parsestr(header_lines)
    return Exchange(status_line.strip(), {k.lower(): v for k, v in message.items()}, body)


def run_page(
    page: Path, workdir: Path, *, timeout: float
) -> tuple[list[Expected], subprocess.CompletedProcess[str]]:
    """Follow ``page`` in a bash session in ``workdir/project``, its answers in ``answers``."""
    out = workdir / "answers"
    out.mkdir()
    project = workdir / "project"
    project.mkdir()
    port = free_port()
    script, expected = session_script(page_blocks(page.read_text()), out, port)
    (workdir / "page.sh").write_text(script)
    env = {
        name: value
        for name, value in os.environ.items()
        # The test suite's own settings must not leak into the reader's project.
        if name not in ("DJANGO_SETTINGS_MODULE", "DATABASE_URL", "PYTHONPATH")
    }
    env.update(
        # ``python`` and ``django-admin`` of the test's virtualenv, importing
        # this checkout of django_idempotency.
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        PYTHONPATH=str(REPO_ROOT),
        PORT=str(port),
        OUT=str(out),
    )
    process = subprocess.Popen(
        ["bash", str(workdir / "page.sh")],
        cwd=project,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its runserver goes with it if the test gives up
    )
    try:
        stdout, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        terminate(process)
        raise
    finally:
        if process.poll() is None:
            terminate(process)
    completed = subprocess.CompletedProcess(process.args, process.returncode, stdout)
    return expected, completed


def follow_page(page: Path, workdir: Path, *, timeout: float) -> list[Expected]:
    """Follow ``page`` (``run_page``), once, in the SQLite pass; fail unless the session did.

    The page's project has its own SQLite database: the other passes would
    repeat the same run.
    """
    if connections["default"].vendor != "sqlite":
        pytest.skip("runs in the SQLite pass (the page's project brings its own database)")
    if shutil.which("curl") is None:
        reason = "the page's requests are made with curl, which is not installed"
        # CI proves the page: there a missing curl fails rather than skips.
        if services_required():
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    expected, completed = run_page(page, workdir, timeout=timeout)
    log = workdir / "answers" / "runserver.log"
    assert completed.returncode == 0, (
        f"the session following {page.name} failed:\n{completed.stdout}\n"
        f"runserver:\n{log.read_text() if log.exists() else ''}"
    )
    return expected


def assert_answers_as_shown(expected: list[Expected]) -> None:
    """Every response and command output the page shows is the one the session got."""
    for item in expected:
        actual = item.output.read_bytes()
        if item.kind == "console":
            assert actual.decode() == item.shown
            continue
        shown = parse_exchange(item.shown.encode())
        got = parse_exchange(actual)
        assert got.status_line == shown.status_line, (item.shown, actual)
        for name, value in shown.headers.items():
            assert got.headers.get(name) == value, (name, item.shown, actual)
        assert got.body == shown.body.rstrip(b"\n"), (item.shown, actual)
