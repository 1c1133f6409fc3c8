"""A PostgreSQL server of the test's own, to stop and start at will.

The store outage tests (``test_store_outage.py``) stop the database in the
middle of a load. They must never do that to the machine's shared server
(the one ``IDEMPOTENCY_TEST_POSTGRES_URL`` names, on port 5432): other test
runs and other people use it. So ``OwnPostgres`` makes a cluster of its own:

- ``initdb`` into a fresh temporary directory (trust authentication, user
  ``postgres``, UTF-8),
- ``pg_ctl start`` on a free port of its own, listening on 127.0.0.1 only,
  with its Unix socket in that directory (never ``/var/run/postgresql``),
- ``stop(mode)`` / ``start()`` as often as the test likes (the port and the
  data stay, so clients reconnect to the same URL after a restart),
- on exit, always (also when the test failed), ``pg_ctl stop -m immediate``
  and the directory removed.

PostgreSQL refuses to run as root. When the tests run as root (the CI
container does), every ``initdb``/``pg_ctl`` runs as the ``postgres`` OS
user through ``runuser`` and the temporary directory is handed to it;
otherwise they run as the current user.

The binaries are looked up in ``IDEMPOTENCY_TEST_PG_BINDIR``, then on
``PATH``, then in ``/usr/lib/postgresql/<newest>/bin`` (Debian's layout).
When none are found, ``require_own_postgres()`` skips the test, or fails it
under ``IDEMPOTENCY_REQUIRE_SERVICES=1``.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import psycopg
import pytest
from psycopg import sql

from tests.live.server import free_port
from tests.live.services import REQUIRE_SERVICES_ENV, services_required

BINDIR_ENV = "IDEMPOTENCY_TEST_PG_BINDIR"
OS_USER = "postgres"
START_TIMEOUT = 30
STOP_TIMEOUT = 30


def find_bindir() -> Path | None:
    """The directory holding ``initdb``, ``pg_ctl`` and ``postgres``, if any."""
    candidates: list[Path] = []
    if os.environ.get(BINDIR_ENV):
        candidates.append(Path(os.environ[BINDIR_ENV]))
    on_path = shutil.which("pg_ctl")
    if on_path:
        candidates.append(Path(on_path).resolve().parent)

    def version(path: str) -> tuple[int, ...]:
        number = Path(path).parent.name
        return tuple(int(part) for part in number.split(".") if part.isdigit())

    candidates.extend(
        Path(path) for path in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=version)[::-1]
    )
    for candidate in candidates:
        if all((candidate / tool).is_file() for tool in ("initdb", "pg_ctl", "postgres")):
            return candidate
    return None


def require_own_postgres() -> Path:
    """The binaries' directory; else skip (or, in CI, fail) the running test."""
    bindir = find_bindir()
    problem = None
    if bindir is None:
        problem = f"initdb/pg_ctl/postgres not found (set {BINDIR_ENV})"
    elif os.geteuid() == 0:
        try:
            pwd.getpwnam(OS_USER)
        except KeyError:
            problem = f"running as root and there is no {OS_USER!r} OS user to run PostgreSQL as"
        if shutil.which("runuser") is None:
            problem = "running as root and runuser is not available"
    if problem is not None:
        if services_required():
            pytest.fail(
                f"a PostgreSQL server of the test's own is required "
                f"({REQUIRE_SERVICES_ENV}=1) but cannot be started: {problem}",
                pytrace=False,
            )
        pytest.skip(f"cannot start a PostgreSQL server of the test's own: {problem}")
    assert bindir is not None
    return bindir


class OwnPostgres:
    """One throw-away PostgreSQL cluster: ``with OwnPostgres() as pg: ... pg.stop() ...``."""

    def __init__(
        self, bindir: Path | None = None, label: str = "own", settings: Sequence[str] = ()
    ) -> None:
        self.bindir = bindir or require_own_postgres()
        self.label = label
        #: More ``name=value`` server settings, passed as ``-c`` at every start.
        self.settings = list(settings)
        self.port = free_port()
        self.root: Path | None = None
        self.running = False
        #: Every pg_ctl/initdb command and its output, for diagnostics.
        self.history: list[str] = []

    # -- paths and URLs ---------------------------------------------------------------

    @property
    def data_dir(self) -> Path:
        assert self.root is not None
        return self.root / "data"

    @property
    def log_path(self) -> Path:
        assert self.root is not None
        return self.root / "postgres.log"

    def url(self, database: str = "postgres") -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/{database}"

    # -- lifecycle --------------------------------------------------------------------

    def __enter__(self) -> OwnPostgres:
        try:
            self.root = Path(tempfile.mkdtemp(prefix=f"idem-pg-{self.label}-"))
            if os.geteuid() == 0:
                entry = pwd.getpwnam(OS_USER)
                os.chown(self.root, entry.pw_uid, entry.pw_gid)
            self._make_data_dir()
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def _make_data_dir(self) -> None:
        """``initdb`` (a standby copies its primary's instead: ``replica.Standby``)."""
        self._run(
            "initdb",
            "-D", str(self.data_dir),
            "-U", "postgres",
            "-A", "trust",
            "-E", "UTF8",
            "--locale=C.UTF-8",
            "--no-sync",
            timeout=60,
        )  # fmt: skip

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def start(self) -> float:
        """``pg_ctl start -w``: returns once the server accepts connections (seconds taken)."""
        started = time.monotonic()
        options = " ".join(
            [
                f"-p {self.port}",
                "-c listen_addresses=127.0.0.1",
                f"-c unix_socket_directories={self.root}",
                "-c max_connections=100",
                # A process stop is the outage under test, not a power cut:
                # the WAL stays on disk either way, so fsync buys nothing here.
                "-c fsync=off",
                "-c full_page_writes=off",
                "-c log_min_messages=warning",
                *(f"-c {setting}" for setting in self.settings),
            ]
        )
        self._run(
            "pg_ctl", "start", "-w", "-t", str(START_TIMEOUT),
            "-D", str(self.data_dir), "-l", str(self.log_path), "-o", options,
            timeout=START_TIMEOUT + 10,
        )  # fmt: skip
        self.running = True
        return time.monotonic() - started

    def stop(self, mode: str = "fast") -> float:
        """``pg_ctl stop -m <mode> -w``: returns once the server is gone (seconds taken)."""
        started = time.monotonic()
        self._run(
            "pg_ctl", "stop", "-w", "-t", str(STOP_TIMEOUT), "-m", mode, "-D", str(self.data_dir),
            timeout=STOP_TIMEOUT + 10,
        )  # fmt: skip
        self.running = False
        return time.monotonic() - started

    def close(self) -> None:
        """Stop the server if it runs (immediately) and remove the directory; never raises."""
        if self.root is None:
            return
        if (self.data_dir / "postmaster.pid").exists():
            with contextlib.suppress(Exception):
                self._run(
                    "pg_ctl", "stop", "-w", "-t", str(STOP_TIMEOUT), "-m", "immediate",
                    "-D", str(self.data_dir), timeout=STOP_TIMEOUT + 10, check=False,
                )  # fmt: skip
        self.running = False
        if os.environ.get("IDEMPOTENCY_LIVE_KEEP_LOGS") == "1":
            with contextlib.suppress(OSError):
                shutil.copy(self.log_path, Path(tempfile.gettempdir()) / self.root.name)
        shutil.rmtree(self.root, ignore_errors=True)
        self.root = None

    # -- databases --------------------------------------------------------------------

    def create_database(self, name: str) -> str:
        """Create database ``name``; returns its URL."""
        with psycopg.connect(self.url(), autocommit=True, connect_timeout=5) as admin:
            admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return self.url(name)

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except (AssertionError, OSError):
            text = ""
        history = "\n".join(self.history[-10:])
        tail = "\n".join(text.splitlines()[-lines:])
        return (
            f"--- own PostgreSQL {self.label} on port {self.port} ---\n{history}\n"
            f"--- its log (last {lines} lines) ---\n{tail}\n--- end ---"
        )

    # -- helpers ----------------------------------------------------------------------

    def _run(self, tool: str, *args: str, timeout: float, check: bool = True) -> str:
        command = [str(self.bindir / tool), *args]
        if os.geteuid() == 0:
            command = ["runuser", "-u", OS_USER, "--", *command]
        env: dict[str, Any] = {**os.environ, "LC_ALL": "C.UTF-8", "LANG": "C.UTF-8"}
        # pg_ctl's children must not inherit the test's PG* connection settings.
        for name in ("PGHOST", "PGPORT", "PGDATA", "PGUSER", "PGDATABASE"):
            env.pop(name, None)
        result = subprocess.run(
            command,
            cwd=self.root or tempfile.gettempdir(),
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        output = (result.stdout + result.stderr).strip()
        self.history.append(f"$ {' '.join(command)} -> {result.returncode}\n{output}")
        if check and result.returncode != 0:
            raise RuntimeError(
                f"{tool} failed with {result.returncode}:\n{output}\n" + self.log_tail()
            )
        return output
