"""What the benchmarks share: a throw-away PostgreSQL database, gunicorn, the machine.

Imported as ``benchmarks.benchlib`` (the repository root on ``sys.path``).
Everything binds to loopback and is torn down on exit.
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg import sql

REPO_ROOT = Path(__file__).resolve().parents[1]
BENCH_SETTINGS = "benchmarks.benchproject.settings"
BENCH_WSGI = "benchmarks.benchproject.wsgi:application"
DEFAULT_POSTGRES_URL = "postgres://postgres@127.0.0.1:5432/postgres"


def postgres_url() -> str:
    """The server to create the benchmark database on (a database there to connect to)."""
    return os.environ.get("IDEMPOTENCY_BENCH_POSTGRES_URL") or DEFAULT_POSTGRES_URL


def database_url(server_url: str, name: str) -> str:
    return urlunsplit(urlsplit(server_url)._replace(path=f"/{name}"))


class Database:
    """A fresh database, created on enter and force-dropped on exit (unless ``keep``)."""

    def __init__(self, server_url: str, prefix: str, keep: bool = False) -> None:
        self.server_url = server_url
        self.name = f"{prefix}_{uuid.uuid4().hex[:12]}"
        self.url = database_url(server_url, self.name)
        self.keep = keep

    def __enter__(self) -> Database:
        with psycopg.connect(self.server_url, autocommit=True, connect_timeout=5) as admin:
            admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(self.name)))
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.keep:
            print(f"kept database {self.name}", file=sys.stderr)
            return
        with psycopg.connect(self.server_url, autocommit=True, connect_timeout=5) as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(self.name))
            )

    def connect(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self.url, autocommit=True, connect_timeout=5)


def django_env(database: Database, settings: str = BENCH_SETTINGS) -> dict[str, str]:
    env = dict(os.environ)
    env["DATABASE_URL"] = database.url
    env["DJANGO_SETTINGS_MODULE"] = settings
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    return env


def migrate(database: Database, settings: str = BENCH_SETTINGS) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "django", "migrate", "--noinput", "--settings", settings],
        cwd=REPO_ROOT,
        env=django_env(database, settings),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"migrate failed:\n{result.stdout}\n{result.stderr}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Gunicorn:
    """gunicorn on 127.0.0.1, no access log: the benchmark project with sync workers by default.

    ``threads`` above 1 runs gthread workers; ``app``, ``settings``, ``env``
    and ``ready_path`` (a GET answering 200 once it serves) serve another
    project, as benchmarks/contention.py serves the test project; ``args``
    go to gunicorn as they are (``-c`` a configuration with hooks, say).
    """

    def __init__(
        self,
        database: Database,
        workers: int,
        *,
        threads: int = 1,
        app: str = BENCH_WSGI,
        settings: str = BENCH_SETTINGS,
        env: dict[str, str] | None = None,
        ready_path: str = "/health",
        args: Sequence[str] = (),
    ) -> None:
        self.database = database
        self.workers = workers
        self.threads = threads
        self.app = app
        self.settings = settings
        self.env = env or {}
        self.ready_path = ready_path
        self.args = tuple(args)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_dir = Path(tempfile.mkdtemp(prefix="idem-bench-"))
        self.log_path = self.log_dir / "gunicorn.log"
        self.process: subprocess.Popen[bytes] | None = None
        self._log_file: Any = None

    def __enter__(self) -> Gunicorn:
        command = [
            sys.executable, "-m", "gunicorn", self.app,
            "-w", str(self.workers), "--threads", str(self.threads),
            "-k", "sync" if self.threads == 1 else "gthread",
            "-b", f"127.0.0.1:{self.port}",
            "--timeout", "60", "--graceful-timeout", "5",
            "--no-control-socket",
            "--error-logfile", "-",
            *self.args,
        ]  # fmt: skip
        # gunicorn's own log and the workers' Django logging (stderr).
        self._log_file = self.log_path.open("ab")
        self.process = subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            env={**django_env(self.database, self.settings), **self.env},
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            self._wait_until_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def _wait_until_ready(self, timeout: float = 60.0) -> None:
        assert self.process is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"gunicorn exited at startup:\n{self.log_text()[-3000:]}")
            booted = len(re.findall(r"Booting worker with pid", self.log_text()))
            with (
                contextlib.suppress(OSError, urllib.error.URLError),
                urllib.request.urlopen(self.url + self.ready_path, timeout=2) as response,
            ):
                if response.status == 200 and booted >= self.workers:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"gunicorn not ready after {timeout:.0f}s:\n{self.log_text()[-3000:]}")

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=15)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def problems(self) -> list[str]:
        pattern = re.compile(r"Traceback|\[ERROR\]|\[CRITICAL\]|WORKER TIMEOUT|Stale owner")
        return [line for line in self.log_text().splitlines() if pattern.search(line)]


def machine() -> dict[str, str]:
    """What the figures were measured on."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    memory = ""
    with contextlib.suppress(OSError, ValueError, IndexError):
        kib = int(Path("/proc/meminfo").read_text().split()[1])
        memory = f"{kib / 1024 / 1024:.0f} GiB"
    commit = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        commit = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout.strip()
    return {
        "cpus": str(os.cpu_count()),
        "cpu": cpu,
        "memory": memory,
        "python": platform.python_version(),
        "commit": commit,
    }


def server_facts(connection: psycopg.Connection[Any]) -> dict[str, str]:
    names = ("server_version", "shared_buffers", "synchronous_commit", "fsync", "autovacuum")
    rows = connection.execute(
        "SELECT name, current_setting(name) FROM pg_settings WHERE name = ANY(%s)", [list(names)]
    ).fetchall()
    return {name: value for name, value in rows}


def load_average() -> str:
    with contextlib.suppress(OSError):
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    return "?"


def percentile(values: Sequence[float], fraction: float) -> float:
    """Nearest-rank percentile (``fraction`` in 0..1) of a non-empty sample."""
    ordered = sorted(values)
    index = max(0, min(len(ordered) - 1, math.ceil(fraction * len(ordered)) - 1))
    return ordered[index]


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


@contextlib.contextmanager
def timed() -> Iterator[list[float]]:
    """``with timed() as t: ...`` then ``t[0]`` is the elapsed seconds."""
    box: list[float] = []
    started = time.perf_counter()
    try:
        yield box
    finally:
        box.append(time.perf_counter() - started)


class Uvicorn:
    """uvicorn on 127.0.0.1, no access log: the benchmark project over ASGI.

    ``env`` is added to the workers' environment (``IDEMPOTENCY_BENCH_POOL``
    for Django's connection pool, say). uvicorn picks uvloop and httptools
    when they are installed (``uvicorn[standard]``); ``loop_and_http()``
    says which it runs.
    """

    def __init__(
        self,
        database: Database,
        workers: int,
        *,
        app: str = "benchmarks.benchproject.asgi:application",
        settings: str = BENCH_SETTINGS,
        env: dict[str, str] | None = None,
        ready_path: str = "/health",
    ) -> None:
        self.database = database
        self.workers = workers
        self.app = app
        self.settings = settings
        self.env = env or {}
        self.ready_path = ready_path
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.mkdtemp(prefix="idem-bench-")) / "uvicorn.log"
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Uvicorn:
        command = [
            sys.executable, "-m", "uvicorn", self.app,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--workers", str(self.workers),
            "--no-access-log", "--log-level", "warning",
        ]  # fmt: skip
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                command,
                cwd=REPO_ROOT,
                env={**django_env(self.database, self.settings), **self.env},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            self._wait_until_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def _wait_until_ready(self, timeout: float = 60.0) -> None:
        assert self.process is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"uvicorn exited at startup:\n{self.log_text()[-3000:]}")
            with (
                contextlib.suppress(OSError, urllib.error.URLError),
                urllib.request.urlopen(self.url + self.ready_path, timeout=2) as response,
            ):
                if response.status == 200:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"uvicorn not ready after {timeout:.0f}s:\n{self.log_text()[-3000:]}")

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=15)

    def problems(self) -> list[str]:
        pattern = re.compile(r"Traceback|ERROR|CRITICAL|Stale owner")
        return [line for line in self.log_text().splitlines() if pattern.search(line)]

    @staticmethod
    def loop_and_http() -> str:
        """The event loop and HTTP parser uvicorn's "auto" picks here."""
        import importlib.util

        loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
        http = "httptools" if importlib.util.find_spec("httptools") else "h11"
        return f"{loop}, {http}"


def process_tree_cpu_seconds(root: int) -> float:
    """CPU time (user + system) used so far by ``root`` and its descendants, threads included.

    Read from /proc (Linux): a server's master and its workers, so that the
    CPU a request costs in the application can be compared apart from how
    busy the machine is. Children that already exited are not counted.
    """
    ticks = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    used: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            # The fields after the command's closing parenthesis (which may hold spaces).
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
            parents[int(entry.name)] = int(fields[1])
            used[int(entry.name)] = (int(fields[11]) + int(fields[12])) / ticks
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in tree]
        tree.update(children)
        frontier.extend(children)
    return sum(used.get(pid, 0.0) for pid in tree)
