"""A PostgreSQL server of the cost script's own: nobody else's transactions, nobody else's WAL.

Why not the machine's shared server: what a request writes is not
entirely its own business there. Whether an UPDATE is HOT, and whether a
read prunes a page (and writes WAL for it), depend on which dead row
versions every snapshot has stopped needing, and another database's open
transaction holds back the snapshots of this one. Two counting passes on
the shared server, with other test suites running, differed in the floors'
HOT updates (0.965 against 0.99 per request) and in WAL bytes. On a server
of its own the figures repeat.

``initdb`` into a temporary directory (trust authentication, user
``postgres``, UTF-8), ``pg_ctl start`` on a free port on 127.0.0.1 with its
Unix socket in that directory, the server's defaults otherwise (``fsync``
and ``synchronous_commit`` on, ``shared_buffers`` 128 MB) but autovacuum
off, as on this machine's shared server: the script vacuums and analyses
before each loop itself, so that no vacuum runs at a moment that differs
from run to run. Stopped (immediately) and removed on exit.

PostgreSQL refuses to run as root: as root, initdb and pg_ctl run as the
``postgres`` OS user (``runuser``). The binaries: ``pg_ctl`` on PATH, else
the newest ``/usr/lib/postgresql/*/bin`` (Debian's layout).
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

from benchmarks.benchlib import free_port

OS_USER = "postgres"


def find_bindir() -> Path | None:
    on_path = shutil.which("pg_ctl")
    candidates = [Path(on_path).resolve().parent] if on_path else []

    def version(path: str) -> tuple[int, ...]:
        return tuple(int(part) for part in Path(path).parent.name.split(".") if part.isdigit())

    candidates += [
        Path(path) for path in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=version)[::-1]
    ]
    for candidate in candidates:
        if all((candidate / tool).is_file() for tool in ("initdb", "pg_ctl", "postgres")):
            return candidate
    return None


class OwnServer:
    """``with OwnServer() as server: server.url`` names its ``postgres`` database."""

    def __init__(self) -> None:
        bindir = find_bindir()
        if bindir is None:
            raise RuntimeError(
                "initdb/pg_ctl/postgres not found (Debian: apt-get install postgresql); "
                "or measure on a shared server: --server shared"
            )
        self.bindir = bindir
        self.port = free_port()
        self.url = f"postgres://postgres@127.0.0.1:{self.port}/postgres"
        self.root: Path | None = None

    def __enter__(self) -> OwnServer:
        try:
            self.root = Path(tempfile.mkdtemp(prefix="idem-bench-pg-"))
            if os.geteuid() == 0:
                entry = pwd.getpwnam(OS_USER)
                os.chown(self.root, entry.pw_uid, entry.pw_gid)
            data = str(self.root / "data")
            self._run(
                "initdb", "-D", data, "-U", "postgres", "-A", "trust", "-E", "UTF8",
                "--locale=C.UTF-8", "--no-sync",
            )  # fmt: skip
            options = (
                f"-p {self.port} -c listen_addresses=127.0.0.1 "
                f"-c unix_socket_directories={self.root} -c autovacuum=off "
                "-c log_min_messages=warning"
            )
            self._run(
                "pg_ctl", "start", "-w", "-t", "60", "-D", data,
                "-l", str(self.root / "postgres.log"), "-o", options,
            )  # fmt: skip
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        if self.root is None:
            return
        data = self.root / "data"
        if (data / "postmaster.pid").exists():
            with contextlib.suppress(Exception):
                self._run("pg_ctl", "stop", "-w", "-m", "immediate", "-D", str(data))
        shutil.rmtree(self.root, ignore_errors=True)
        self.root = None

    def _run(self, tool: str, *args: str) -> None:
        command = [str(self.bindir / tool), *args]
        if os.geteuid() == 0:
            command = ["runuser", "-u", OS_USER, "--", *command]
        env = {**os.environ, "LC_ALL": "C.UTF-8", "LANG": "C.UTF-8"}
        for name in ("PGHOST", "PGPORT", "PGDATA", "PGUSER", "PGDATABASE"):
            env.pop(name, None)
        result = subprocess.run(
            command,
            cwd=self.root or tempfile.gettempdir(),
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if result.returncode != 0:
            log = ""
            if self.root is not None:
                with contextlib.suppress(OSError):
                    log = (self.root / "postgres.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(
                f"{tool} failed ({result.returncode}): {result.stdout}{result.stderr}\n{log}"
            )
