"""Real worker processes of the Tasks framework's database backend, for the live tests.

``DbWorker`` is ``python -m django db_worker`` with the test settings
(``tests.settings``: ``TASKS`` names the database backend) on the test
run's own database (``tests.utils.database_url()``), in a process group of
its own, its output in a log file: what a deployment runs, pointed at the
database pytest-django made for this run. ``stop()`` is the worker's
graceful shutdown (SIGTERM: it finishes the task it runs); ``kill()`` is a
SIGKILL of the whole group, a machine dying mid-task.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tests.live.server import terminate
from tests.utils import REPO, database_url

STARTUP_TIMEOUT = 60.0
STOP_TIMEOUT = 15.0
#: Seconds between a worker's looks for ready tasks (its --interval).
POLL_INTERVAL = 0.1


class DbWorker:
    def __init__(self, log_dir: Path, environment: Mapping[str, str]) -> None:
        self.worker_id = f"live-{uuid.uuid4().hex[:8]}"
        self.log_path = log_dir / f"{self.worker_id}.log"
        self.command = [
            sys.executable, "-m", "django", "db_worker",
            "--no-startup-delay", "--no-reload", f"--interval={POLL_INTERVAL}",
            f"--worker-id={self.worker_id}", "--verbosity=2",
        ]  # fmt: skip
        self.environment = {
            **os.environ,
            "DATABASE_URL": database_url(),
            "DJANGO_SETTINGS_MODULE": "tests.settings",
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "PYTHONUNBUFFERED": "1",
            **environment,
        }
        self.process: subprocess.Popen[bytes] | None = None
        self._log: Any = None

    def start(self) -> DbWorker:
        """Start the worker and wait until it looks for tasks."""
        self.spawn()
        self.wait_until_ready()
        return self

    def spawn(self) -> None:
        self._log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            self.command,
            cwd=REPO,
            env=self.environment,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: kill() takes it whole
        )

    def wait_until_ready(self) -> None:
        """Until the worker looks for tasks."""
        wait_until(
            lambda: f"Starting worker worker_id={self.worker_id}" in self.log_text(),
            STARTUP_TIMEOUT,
            self.diagnostics,
            alive=self.process,
        )

    def kill(self) -> None:
        """SIGKILL the worker's process group: no handler runs, nothing is written."""
        process, self.process = self.process, None
        if process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=STOP_TIMEOUT)
        self._close_log()

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is not None:
            terminate(process, STOP_TIMEOUT)
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def diagnostics(self, lines: int = 60) -> str:
        tail = "\n".join(self.log_text().splitlines()[-lines:])
        return f"--- db_worker {self.worker_id} log {self.log_path} ---\n{tail}\n---"


def wait_until(
    condition: Callable[[], bool],
    timeout: float,
    describe: Callable[[], str],
    *,
    alive: subprocess.Popen[bytes] | None = None,
    step: float = 0.05,
) -> None:
    """Poll ``condition`` until true; else fail with ``describe()`` (early if ``alive`` died)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        if alive is not None and alive.poll() is not None:
            raise AssertionError(f"the process exited with {alive.returncode}:\n{describe()}")
        time.sleep(step)
    if condition():
        return
    raise AssertionError(f"not within {timeout:.0f}s:\n{describe()}")
