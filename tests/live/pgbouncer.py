"""A PgBouncer of the test's own, in transaction pooling, in front of the test server.

``PgBouncer(...)`` is a context manager that

- writes ``pgbouncer.ini`` and a ``userlist.txt`` into a fresh temporary
  directory: listening on a free port of 127.0.0.1 (no Unix socket),
  ``pool_mode = transaction``, trust authentication for the user
  ``postgres``, the given ``default_pool_size`` and ``query_wait_timeout``;
- routes a wildcard database entry (``* = host=... port=...``) to the
  PostgreSQL server of ``IDEMPOTENCY_TEST_POSTGRES_URL`` (5432 by default),
  so that every per-test database is reachable under its own name, plus any
  named ``entries`` (``PgBouncerEntry``: another name for a database with a
  pool of its own, e.g. the intents' pool of ``INTENT_DATABASES``);
- starts ``/usr/sbin/pgbouncer`` in the foreground (its own session), as
  the ``postgres`` OS user when the tests run as root (PgBouncer refuses to
  run as root), and waits until its admin console answers;
- on exit, always, stops it (SIGTERM, then SIGKILL) and removes the directory.

Databases are created and dropped directly on the server, never through
PgBouncer: DROP DATABASE fails while PgBouncer holds server connections to
it (the live harness drops ``WITH (FORCE)``, which ends them).

``require_pgbouncer()`` skips the test when the binary is missing, or fails
it under ``IDEMPOTENCY_REQUIRE_SERVICES=1``.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest

from tests.live.server import terminate
from tests.live.services import REQUIRE_SERVICES_ENV, postgres_url, services_required

BINARY_ENV = "IDEMPOTENCY_TEST_PGBOUNCER_BINARY"
DEFAULT_BINARY = "/usr/sbin/pgbouncer"
OS_USER = "postgres"
START_TIMEOUT = 15.0
STOP_TIMEOUT = 10.0


def find_pgbouncer() -> str | None:
    """The pgbouncer binary: ``IDEMPOTENCY_TEST_PGBOUNCER``, then PATH, then Debian's path."""
    for candidate in (os.environ.get(BINARY_ENV), shutil.which("pgbouncer"), DEFAULT_BINARY):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def require_pgbouncer() -> str:
    """The binary's path; else skip (or, in CI, fail) the running test."""
    binary = find_pgbouncer()
    problem = None
    if binary is None:
        problem = f"pgbouncer not found (apt-get install pgbouncer, or set {BINARY_ENV})"
    elif os.geteuid() == 0:
        try:
            pwd.getpwnam(OS_USER)
        except KeyError:
            problem = f"running as root and there is no {OS_USER!r} OS user to run PgBouncer as"
    if problem is not None:
        if services_required():
            pytest.fail(
                f"PgBouncer is required ({REQUIRE_SERVICES_ENV}=1) but cannot be started: "
                f"{problem}",
                pytrace=False,
            )
        pytest.skip(f"cannot start PgBouncer: {problem}")
    assert binary is not None
    return binary


@dataclass(frozen=True)
class PgBouncerEntry:
    """A database entry of its own: ``name = host=... port=... dbname=database pool_size=...``."""

    name: str
    database: str
    pool_size: int | None = None


class PgBouncer:
    """One throw-away PgBouncer: ``with PgBouncer(pool_size=2) as bouncer: bouncer.url(name)``."""

    def __init__(
        self,
        *,
        server_url: str | None = None,
        pool_size: int = 20,
        query_wait_timeout: float = 120,
        entries: Sequence[PgBouncerEntry] = (),
        max_client_conn: int = 500,
        label: str = "pgbouncer",
    ) -> None:
        self.binary = require_pgbouncer()
        server = urlsplit(server_url or postgres_url())
        self.server_host = server.hostname or "127.0.0.1"
        self.server_port = server.port or 5432
        self.user = server.username or "postgres"
        self.pool_size = pool_size
        self.query_wait_timeout = query_wait_timeout
        self.entries = tuple(entries)
        self.max_client_conn = max_client_conn
        self.label = label
        from tests.live.server import free_port

        self.port = free_port()
        self.root: Path | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self._log: Any = None

    # -- URLs -------------------------------------------------------------------------

    def url(self, database: str) -> str:
        """A URL of ``database`` (a server database, or an entry's name) through PgBouncer."""
        return f"postgres://{self.user}@127.0.0.1:{self.port}/{database}"

    def rewrite(self, direct_url: str) -> str:
        """``direct_url`` (on the server) with PgBouncer's host and port instead."""
        parts = urlsplit(direct_url)
        netloc = f"{parts.username or self.user}@127.0.0.1:{self.port}"
        return urlunsplit(parts._replace(netloc=netloc))

    @property
    def config_path(self) -> Path:
        assert self.root is not None
        return self.root / "pgbouncer.ini"

    @property
    def log_path(self) -> Path:
        assert self.root is not None
        return self.root / "pgbouncer.log"

    # -- lifecycle --------------------------------------------------------------------

    def __enter__(self) -> PgBouncer:
        try:
            self.root = Path(tempfile.mkdtemp(prefix=f"idem-{self.label}-"))
            self._write_config()
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _write_config(self) -> None:
        assert self.root is not None
        server = f"host={self.server_host} port={self.server_port}"
        databases = [
            f"{entry.name} = {server} dbname={entry.database}"
            + (f" pool_size={entry.pool_size}" if entry.pool_size is not None else "")
            for entry in self.entries
        ]
        # The wildcard last: named entries win, every other name is a database.
        databases.append(f"* = {server}")
        settings = {
            "listen_addr": "127.0.0.1",
            "listen_port": str(self.port),
            "unix_socket_dir": "",
            "auth_type": "trust",
            "auth_file": str(self.root / "userlist.txt"),
            "admin_users": self.user,
            "stats_users": self.user,
            "pool_mode": "transaction",
            "default_pool_size": str(self.pool_size),
            "min_pool_size": "0",
            "reserve_pool_size": "0",
            "max_client_conn": str(self.max_client_conn),
            "query_wait_timeout": f"{self.query_wait_timeout:g}",
            # Only used in session pooling; stated so that the docs can say so.
            "server_reset_query": "DISCARD ALL",
            "server_reset_query_always": "0",
            "logfile": str(self.log_path),
            "pidfile": str(self.root / "pgbouncer.pid"),
            "log_connections": "0",
            "log_disconnections": "0",
        }
        lines = ["[databases]", *databases, "", "[pgbouncer]"]
        lines += [f"{name} = {value}" for name, value in settings.items()]
        self.config_path.write_text("\n".join(lines) + "\n")
        (self.root / "userlist.txt").write_text(f'"{self.user}" ""\n')
        if os.geteuid() == 0:
            entry = pwd.getpwnam(OS_USER)
            for path in (self.root, *self.root.iterdir()):
                os.chown(path, entry.pw_uid, entry.pw_gid)

    def _start(self) -> None:
        assert self.root is not None
        run_as: dict[str, Any] = {}
        if os.geteuid() == 0:
            entry = pwd.getpwnam(OS_USER)
            run_as = {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}
        self._log = (self.root / "stdout.log").open("ab")
        self.process = subprocess.Popen(
            [self.binary, str(self.config_path)],
            cwd=self.root,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            **run_as,
        )
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"pgbouncer exited with {self.process.returncode} at start-up.\n"
                    + self.diagnostics()
                )
            try:
                self.admin("SHOW VERSION")
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"pgbouncer did not answer within {START_TIMEOUT:.0f}s.\n"
                        + self.diagnostics()
                    ) from None
                time.sleep(0.05)

    def close(self) -> None:
        """Stop PgBouncer if it runs and remove its directory; never raises."""
        process, self.process = self.process, None
        if process is not None:
            terminate(process, STOP_TIMEOUT)
        if self._log is not None:
            self._log.close()
            self._log = None
        if self.root is not None:
            if os.environ.get("IDEMPOTENCY_LIVE_KEEP_LOGS") == "1":
                with contextlib.suppress(OSError):
                    shutil.copy(self.log_path, Path(tempfile.gettempdir()) / self.root.name)
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None

    # -- the admin console ------------------------------------------------------------

    def admin(self, command: str) -> list[dict[str, Any]]:
        """A command of the admin console (``SHOW POOLS``, ...), its rows as dicts.

        The console speaks the simple query protocol only: a ``ClientCursor``.
        """
        with (
            psycopg.connect(
                self.url("pgbouncer"),
                autocommit=True,
                connect_timeout=3,
                cursor_factory=psycopg.ClientCursor,
            ) as console,
            console.cursor() as cursor,
        ):
            cursor.execute(command)
            if cursor.description is None:
                return []
            names = [column.name for column in cursor.description]
            return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]

    def pools(self) -> dict[str, Mapping[str, Any]]:
        """``SHOW POOLS``, by database name."""
        return {str(row["database"]): row for row in self.admin("SHOW POOLS")}

    def stats(self) -> dict[str, Mapping[str, Any]]:
        """``SHOW STATS``, by database name."""
        return {str(row["database"]): row for row in self.admin("SHOW STATS")}

    # -- diagnostics ------------------------------------------------------------------

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except (AssertionError, OSError):
            return ""

    def diagnostics(self, lines: int = 40) -> str:
        tail = "\n".join(self.log_text().splitlines()[-lines:])
        config = ""
        with contextlib.suppress(AssertionError, OSError):
            config = self.config_path.read_text()
        return (
            f"--- {self.label} on port {self.port} ---\n{config}"
            f"--- its log (last {lines} lines) ---\n{tail}\n--- end ---"
        )
