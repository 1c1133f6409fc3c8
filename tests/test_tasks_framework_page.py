"""The complete example of docs/tasks-framework.md, followed the way a reader follows it.

In an empty temporary directory, one bash session types the page's "A
complete example" section in order: each shell block as shown (the lines
that make a virtualenv and install the package left out: the test's
interpreter has it, as the wheel installs it, and nothing of the
repository's tests or demo is importable), each code block with a file
name written to that file, each console block's commands run and their
output compared with what the page shows. The project has its own SQLite
database and runs the real ``db_worker``.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from django.db import connections

pytestmark = pytest.mark.live

PAGE = Path(__file__).resolve().parent.parent / "docs" / "tasks-framework.md"
SECTION = "## A complete example"
#: The lines that make a virtualenv and install the package: the test's own has it.
ENVIRONMENT_SETUP = ("python -m venv ", "source ", "pip install ")
TIMEOUT = 120

_FENCE = re.compile(r"^```(?P<lang>[\w-]*)(?P<attrs>[^\n]*)\n(?P<body>.*?)^```[ \t]*$", re.M | re.S)
_TITLE = re.compile(r'title="(?P<path>[^" ]+)(?P<append> \(add at the end\))?"')


@dataclass(frozen=True)
class Shown:
    """What the page shows a console block printing, and where its real output went."""

    commands: list[str]
    output: str
    path: Path


def example_blocks() -> list[re.Match[str]]:
    text = PAGE.read_text()
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    return list(_FENCE.finditer(section))


def session(out: Path) -> tuple[str, list[Shown]]:
    """The bash session that follows the section, and what its consoles must print."""
    lines = ["set -euo pipefail"]
    shown: list[Shown] = []
    for block in example_blocks():
        title = _TITLE.search(block["attrs"])
        body = block["body"]
        if title is not None:
            redirect = ">>" if title["append"] else ">"
            lines.append(f"cat {redirect} {shlex.quote(title['path'])} <<'PAGE_FILE_END'")
            lines.append(("\n" if title["append"] else "") + body.rstrip("\n"))
            lines.append("PAGE_FILE_END")
        elif block["lang"] == "sh":
            lines += [line for line in body.splitlines() if not line.startswith(ENVIRONMENT_SETUP)]
        elif block["lang"] == "console":
            commands = [line[2:] for line in body.splitlines() if line.startswith("$ ")]
            printed = "".join(f"{line}\n" for line in body.splitlines() if not line.startswith("$"))
            output = out / f"console-{len(shown)}.txt"
            lines.append(f"{{\n{chr(10).join(commands)}\n}} > {shlex.quote(str(output))}")
            shown.append(Shown(commands, printed, output))
    return "\n".join(lines) + "\n", shown


def test_the_section_writes_the_projects_files_and_shows_the_workers_outcome() -> None:
    blocks = example_blocks()
    written = {
        title["path"] for block in blocks if (title := _TITLE.search(block["attrs"])) is not None
    }
    assert written == {"shop/settings.py", "orders/models.py", "orders/tasks.py", "check.py"}
    _, shown = session(Path("/nonexistent"))
    assert any("db_worker" in command for each in shown for command in each.commands)
    assert shown[-1].output.endswith("shipments: 1\n")


def test_every_output_the_example_shows_is_what_its_commands_print(tmp_path: Path) -> None:
    if connections["default"].vendor != "sqlite":
        pytest.skip("runs in the SQLite pass (the example's project brings its own database)")
    out = tmp_path / "out"
    out.mkdir()
    project = tmp_path / "project"
    project.mkdir()
    script, shown = session(out)
    (tmp_path / "session.sh").write_text(script)
    env = {
        name: value
        for name, value in os.environ.items()
        # The suite's own settings and checkout must not leak into the reader's project.
        if name not in ("DJANGO_SETTINGS_MODULE", "DATABASE_URL", "PYTHONPATH")
    }
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"

    completed = subprocess.run(
        ["bash", str(tmp_path / "session.sh")],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )

    assert completed.returncode == 0, f"{completed.stdout}\n{completed.stderr}"
    for each in shown:
        assert each.path.read_text() == each.output, each.commands
