"""A real deployment for the live tests: a fresh PostgreSQL database and gunicorn.

``live_server()`` is a context manager that

1. creates a uniquely named database (``idem_live_<random>``) on the server
   given by ``IDEMPOTENCY_TEST_POSTGRES_URL``,
2. runs ``python -m django migrate --settings tests.settings`` into it,
3. starts ``gunicorn tests.live.wsgi:application`` (4 sync workers, one
   thread each, unless a configuration's ``IDEMPOTENCY_TEST_GUNICORN_*``
   variables say otherwise) on a free local port with ``DATABASE_URL`` pointing at it
   (or another ``Project``: ``PAYMENTS_PROJECT`` serves the demo project's
   payments API, for the crash tests),
4. waits until every worker has booted and the server answers, and yields a
   ``LiveServer`` (base URL, queries on the live database, the server log),
5. on exit stops gunicorn and drops the database (``WITH (FORCE)``).

Worker output (error log, Django's logging and an access log naming the pid,
the key and whether the answer was a replay) goes to a temporary file whose
tail ``LiveServer.diagnostics()`` adds to assertion messages.

``LazyLiveServer`` is for module-scoped pytest fixtures: the server starts on
the first ``get()`` *inside a test*, so that ``require_postgres()`` skips or
fails that test (not its setup) when PostgreSQL is absent.

``fire_together()`` sends many requests at once, one thread and one
``requests.Session`` each, released together by a barrier.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar
from urllib.parse import urlsplit, urlunsplit

import psycopg
import requests
from psycopg import sql

from tests.live.services import postgres_url, require_postgres

if TYPE_CHECKING:
    from tests.live.pgbouncer import PgBouncer

REPO_ROOT = Path(__file__).resolve().parents[2]
# gunicorn's worker model, set by a configuration of the matrix
# (tests/configurations/): e.g. gthread, 2 processes x 4 threads, where
# requests of one process run at once, each thread on its own connections.
WORKERS = int(os.environ.get("IDEMPOTENCY_TEST_GUNICORN_WORKERS") or 4)
WORKER_CLASS = os.environ.get("IDEMPOTENCY_TEST_GUNICORN_WORKER_CLASS") or "sync"
THREADS = int(os.environ.get("IDEMPOTENCY_TEST_GUNICORN_THREADS") or 1)
DEFAULT_APP = "tests.live.wsgi:application"
STARTUP_TIMEOUT = 60.0
STOP_TIMEOUT = 15.0
KEEP_LOGS_ENV = "IDEMPOTENCY_LIVE_KEEP_LOGS"
T = TypeVar("T")

#: pid, request line, status, bytes, duration, and the idempotency headers.
ACCESS_LOG_FORMAT = (
    'access pid=%(p)s "%(r)s" %(s)s %(B)sB %(M)sms '
    "key=%({idempotency-key}i)s replayed=%({idempotent-replayed}o)s"
)


def terminate(process: subprocess.Popen[Any], timeout: float = STOP_TIMEOUT) -> None:
    """SIGTERM ``process`` (started in a session of its own) and wait; SIGKILL its group late."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=timeout)
    else:
        process.wait()


class Lazy(Generic[T]):
    """Enters ``start()`` (a context manager) on the first ``get()``; ``close()`` exits it.

    ``get()`` runs ``require()`` first, so that missing services skip the
    calling test (or fail it under ``IDEMPOTENCY_REQUIRE_SERVICES=1``), and
    a start-up that failed once is not retried by every later test.
    """

    def __init__(
        self,
        start: Callable[[], contextlib.AbstractContextManager[T]],
        require: Callable[[], object],
    ) -> None:
        self._start = start
        self._require = require
        self._stack = contextlib.ExitStack()
        self._value: T | None = None
        self._startup_error: BaseException | None = None

    def get(self) -> T:
        self._require()
        if self._startup_error is not None:
            raise RuntimeError("it failed to start earlier") from self._startup_error
        if self._value is None:
            try:
                self._value = self._stack.enter_context(self._start())
            except BaseException as exc:
                self._startup_error = exc
                raise
        return self._value

    def close(self) -> None:
        self._value = None
        self._stack.close()


@dataclass(frozen=True)
class Project:
    """What a live gunicorn serves: settings, WSGI app, import path, readiness probe."""

    settings: str
    app: str
    #: Directories prepended to PYTHONPATH (the demo project lives in testproject/).
    pythonpath: tuple[Path, ...] = ()
    #: A GET that answers once the app is loaded, and the statuses that mean so.
    ready_path: str = "/"
    ready_statuses: tuple[int, ...] = (200,)
    #: The processes' working directory, first on their ``sys.path`` (``python -m``):
    #: another tree (a previous release's, tests/previous_release.py) is served from its own.
    root: Path = REPO_ROOT


#: The test suite's views (tests.testapp) with the live hooks (tests.live.hooks).
TESTS_PROJECT = Project(
    settings="tests.settings",
    app=DEFAULT_APP,
    ready_path="/api-view/charges",
    ready_statuses=(200,),
)
#: The demo project (testproject/): the payments API, its reconciler and, with
#: PAYMENTS_CRASH_HOOKS=1, its crash points.
PAYMENTS_PROJECT = Project(
    # testproject.settings with the matrix's configuration applied.
    settings="tests.live.payments_settings",
    app="testproject.wsgi:application",
    # The repository root too: the Celery worker runs from testproject/ and
    # must import tests.live.payments_settings.
    pythonpath=(REPO_ROOT / "testproject", REPO_ROOT),
    ready_path="/v1/payments",
    ready_statuses=(401,),  # token authentication: anonymous is refused
)


def database_url(server_url: str, name: str) -> str:
    """``server_url`` with its database replaced by ``name`` (query string kept)."""
    parts = urlsplit(server_url)
    return urlunsplit(parts._replace(path=f"/{name}"))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


#: Set by the matrix's PgBouncer cell (tests/configurations/): every live
#: database gets a PgBouncer in transaction pooling, and the app processes
#: (gunicorn, Celery, management commands) reach it only through that.
LIVE_PGBOUNCER_ENV = "IDEMPOTENCY_TEST_LIVE_PGBOUNCER"
#: The URL of the intents' pool (``INTENT_DATABASES``), read by the settings.
INTENT_DATABASE_URL_ENV = "IDEMPOTENCY_TEST_INTENT_DATABASE_URL"
#: That cell's pools: smaller than the app's database clients (4 gunicorn
#: workers, a Celery worker), so that server connections change hands all
#: the time; the intents' pool of its own keeps begin_external() out of the
#: self-deadlock (tests/live/test_pgbouncer.py shows it).
LIVE_PGBOUNCER_POOL_SIZE = 3
LIVE_PGBOUNCER_INTENT_POOL_SIZE = 2
LIVE_PGBOUNCER_QUERY_WAIT_TIMEOUT = 30.0


class LiveDatabase:
    """A fresh database on the test server, created on enter and force-dropped on exit.

    Created and dropped directly on the server. The app's processes use
    ``app_environment()``: the same database, through a PgBouncer of its own
    when ``IDEMPOTENCY_TEST_LIVE_PGBOUNCER=1``; the test's own queries
    (``query()``, ...) go directly to the server.
    """

    def __init__(self, server_url: str | None = None, prefix: str = "idem_live") -> None:
        self.server_url = server_url or postgres_url()
        self.name = f"{prefix}_{uuid.uuid4().hex[:12]}"
        self.url = database_url(self.server_url, self.name)
        self.bouncer: PgBouncer | None = None
        self._connection: psycopg.Connection[Any] | None = None
        self._lock = threading.Lock()

    def __enter__(self) -> LiveDatabase:
        with psycopg.connect(self.server_url, autocommit=True, connect_timeout=5) as admin:
            admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(self.name)))
            if self.server_url == postgres_url():
                # The live tests' own server, which no test stops: its sessions
                # need not wait for the WAL flush at each commit (a killed
                # worker's commits are in the server already). Not on the
                # clusters the outage tests stop with `pg_ctl stop -m immediate`.
                admin.execute(
                    sql.SQL("ALTER DATABASE {} SET synchronous_commit = off").format(
                        sql.Identifier(self.name)
                    )
                )
        if os.environ.get(LIVE_PGBOUNCER_ENV) == "1":
            try:
                self.bouncer = self._start_bouncer()
            except BaseException:
                self.__exit__()
                raise
        return self

    def _start_bouncer(self) -> PgBouncer:
        from tests.live.pgbouncer import PgBouncer, PgBouncerEntry

        bouncer = PgBouncer(
            server_url=self.server_url,
            pool_size=LIVE_PGBOUNCER_POOL_SIZE,
            query_wait_timeout=LIVE_PGBOUNCER_QUERY_WAIT_TIMEOUT,
            entries=[
                PgBouncerEntry(
                    self.intents_entry, self.name, pool_size=LIVE_PGBOUNCER_INTENT_POOL_SIZE
                )
            ],
        )
        return bouncer.__enter__()

    @property
    def intents_entry(self) -> str:
        """The PgBouncer database entry of the intents' pool."""
        return f"{self.name}_intents"

    @property
    def app_url(self) -> str:
        """The URL the app's processes use: through PgBouncer when there is one."""
        return self.bouncer.url(self.name) if self.bouncer is not None else self.url

    def app_environment(self) -> dict[str, str]:
        """``DATABASE_URL`` (and the intents' pool) for the app's processes."""
        env = {"DATABASE_URL": self.app_url, INTENT_DATABASE_URL_ENV: ""}
        if self.bouncer is not None:
            env[INTENT_DATABASE_URL_ENV] = self.bouncer.url(self.intents_entry)
        return env

    def __exit__(self, *exc_info: object) -> None:
        self.close_connection()
        bouncer, self.bouncer = self.bouncer, None
        if bouncer is not None:
            bouncer.close()
        with psycopg.connect(self.server_url, autocommit=True, connect_timeout=5) as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(self.name))
            )

    # -- queries on the live database -------------------------------------------------

    @property
    def connection(self) -> psycopg.Connection[Any]:
        """An autocommit connection: every query sees what the workers committed."""
        if self._connection is None or self._connection.closed:
            self._connection = psycopg.connect(self.url, autocommit=True, connect_timeout=5)
        return self._connection

    def close_connection(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def query(self, statement: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            return self.connection.execute(statement, params).fetchall()

    def count_charges(self, note: str | None = None) -> int:
        """Rows in ``testapp_charge`` (with this ``note``): one per execution of a view."""
        if note is None:
            rows = self.query("SELECT count(*) FROM testapp_charge")
        else:
            rows = self.query("SELECT count(*) FROM testapp_charge WHERE note = %s", [note])
        return int(rows[0][0])

    def charge_ids(self, note: str) -> list[int]:
        rows = self.query("SELECT id FROM testapp_charge WHERE note = %s ORDER BY id", [note])
        return [int(row[0]) for row in rows]

    def count_records(self, key: str | None = None) -> int:
        """Rows in ``django_idempotency_record`` (with this client key)."""
        if key is None:
            rows = self.query("SELECT count(*) FROM django_idempotency_record")
        else:
            rows = self.query(
                'SELECT count(*) FROM django_idempotency_record WHERE "key" = %s', [key]
            )
        return int(rows[0][0])

    def records(self, key: str) -> list[dict[str, Any]]:
        """The records for a client key, as dicts (state, status, body, ...)."""
        with self._lock:
            cursor = self.connection.execute(
                'SELECT id, tenant, operation, "key", state, fencing_token, response_status, '
                "response_body, lease_owner FROM django_idempotency_record "
                'WHERE "key" = %s ORDER BY id',
                [key],
            )
            names = [column.name for column in cursor.description or ()]
            return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


class MariaDBLiveDatabase(LiveDatabase):
    """The same on a MariaDB server (``mysql://``), for the matrix's MariaDB live cells."""

    def _admin(self) -> Any:
        import pymysql

        parts = urlsplit(self.server_url)
        return pymysql.connect(
            host=parts.hostname or "127.0.0.1",
            port=parts.port or 3306,
            user=parts.username or "root",
            password=parts.password or "",
            autocommit=True,
            connect_timeout=5,
        )

    def __enter__(self) -> MariaDBLiveDatabase:
        with self._admin() as admin, admin.cursor() as cursor:
            cursor.execute(f"CREATE DATABASE `{self.name}` CHARACTER SET utf8mb4")
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close_connection()
        with self._admin() as admin, admin.cursor() as cursor:
            cursor.execute(f"DROP DATABASE IF EXISTS `{self.name}`")

    @property
    def connection(self) -> Any:
        if self._connection is None or not self._connection.open:  # type: ignore[attr-defined]
            self._connection = self._admin()
            with self._connection.cursor() as cursor:
                cursor.execute(f"USE `{self.name}`")
                # The queries above quote "key" the standard way.
                cursor.execute("SET SESSION sql_mode = CONCAT(@@sql_mode, ',ANSI_QUOTES')")
                # Every query sees what the workers committed since the last one.
                cursor.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
        return self._connection

    def query(self, statement: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        # PostgreSQL's "= ANY(%s)" with a list: PyMySQL renders a tuple as (a, b, ...).
        statement = statement.replace("= ANY(%s)", "IN %s")
        values = [tuple(value) if isinstance(value, list) else value for value in params]
        with self._lock, self.connection.cursor() as cursor:
            cursor.execute(statement, values)
            return list(cursor.fetchall())

    def records(self, key: str) -> list[dict[str, Any]]:
        with self._lock, self.connection.cursor() as cursor:
            cursor.execute(
                'SELECT id, tenant, operation, "key", state, fencing_token, response_status, '
                "response_body, lease_owner FROM django_idempotency_record "
                'WHERE "key" = %s ORDER BY id',
                [key],
            )
            names = [column[0] for column in cursor.description or ()]
            return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


def live_database(server_url: str | None = None, prefix: str = "idem_live") -> LiveDatabase:
    """A ``LiveDatabase`` on ``server_url``'s kind of server (PostgreSQL or MariaDB)."""
    url = server_url or postgres_url()
    if url.startswith("mysql"):
        return MariaDBLiveDatabase(url, prefix)
    return LiveDatabase(url, prefix)


class LiveServer:
    """gunicorn serving ``project`` (``tests.live.wsgi`` by default) on ``database``."""

    def __init__(
        self,
        database: LiveDatabase,
        workers: int = WORKERS,
        app: str | None = None,
        extra_env: Mapping[str, str] | None = None,
        project: Project = TESTS_PROJECT,
        extra_args: Sequence[str] = (),
        log_dir: Path | None = None,
    ) -> None:
        self.database = database
        self.workers = workers
        self.project = project
        self.app = app or project.app
        self.extra_env = dict(extra_env or {})
        self.extra_args = list(extra_args)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.run_id = uuid.uuid4().hex[:8]
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix="idem-live-"))
        self.log_path = self.log_dir / "gunicorn.log"
        self.process: subprocess.Popen[bytes] | None = None
        self._log_file: Any = None

    # -- lifecycle --------------------------------------------------------------------

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.database.app_environment())
        env["DJANGO_SETTINGS_MODULE"] = self.project.settings
        env["PYTHONUNBUFFERED"] = "1"
        if self.project.pythonpath:
            paths = [str(path) for path in self.project.pythonpath]
            env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")]).rstrip(
                os.pathsep
            )
        env.update(self.extra_env)
        return env

    def migrate(self) -> None:
        self.manage("migrate", "--noinput")

    def manage(self, *args: str) -> str:
        """``django-admin <args>`` on the live database with the project's settings."""
        command = [sys.executable, "-m", "django", *args, "--settings", self.project.settings]
        result = subprocess.run(
            command,
            cwd=self.project.root,
            env=self.environment(),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        with self.log_path.open("a") as log:
            log.write(f"$ {' '.join(command)}\n{result.stdout}{result.stderr}\n")
        if result.returncode != 0:
            raise RuntimeError(
                f"{args[0]} on {self.database.name} failed ({result.returncode}):\n"
                f"{result.stdout}\n{result.stderr}"
            )
        return result.stdout

    def start(self) -> None:
        command = [
            sys.executable, "-m", "gunicorn", self.app,
            "-w", str(self.workers), "-k", WORKER_CLASS, "--threads", str(THREADS),
            "-b", f"127.0.0.1:{self.port}",
            "--timeout", "60", "--graceful-timeout", "5",
            # gunicorn >= 24 opens a control socket at a fixed per-user path by
            # default; parallel servers would fight over it.
            "--no-control-socket",
            "--access-logfile", "-", "--access-logformat", ACCESS_LOG_FORMAT,
            "--error-logfile", "-",
            *self.extra_args,
        ]  # fmt: skip
        self._log_file = self.log_path.open("ab")
        self._log_file.write(f"$ {' '.join(command)}\n".encode())
        self._log_file.flush()
        self.process = subprocess.Popen(
            command,
            cwd=self.project.root,
            env=self.environment(),
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stop() can reap the workers
        )
        self._wait_until_ready()

    def _wait_until_ready(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + STARTUP_TIMEOUT
        answered = False
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"gunicorn exited with {self.process.returncode} during startup.\n"
                    + self.diagnostics()
                )
            booted = len(re.findall(r"Booting worker with pid", self.log_text()))
            if not answered:
                with contextlib.suppress(requests.RequestException):
                    response = requests.get(self.url + self.project.ready_path, timeout=2)
                    response.close()
                    answered = response.status_code in self.project.ready_statuses
            if answered and booted >= self.workers:
                self._warm_up()
                self._check_through_bouncer()
                return
            time.sleep(0.1)
        raise RuntimeError(
            f"gunicorn did not become ready within {STARTUP_TIMEOUT:.0f}s.\n" + self.diagnostics()
        )

    def _check_through_bouncer(self) -> None:
        """Behind the PgBouncer cell's bouncer, the app's queries did go through it."""
        bouncer = self.database.bouncer
        if bouncer is None or self.environment()["DATABASE_URL"] != self.database.app_url:
            return
        served = int(bouncer.stats().get(self.database.name, {}).get("total_query_count", 0))
        if served == 0:
            raise RuntimeError(
                "the app's processes did not reach the database through PgBouncer.\n"
                + bouncer.diagnostics()
            )

    def _warm_up(self) -> None:
        """A few simultaneous GETs, so that every worker has loaded the views.

        A cold worker's first request is slow (imports, URL resolver); in a
        storm it would only arrive after the winner finished, and the first
        round would race less than the others.
        """
        for _ in range(2):
            fire_together(
                [Call(self.url + self.project.ready_path, None, {}, method="GET")]
                * (self.workers * 3),
                timeout=10,
            )

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is not None:
            terminate(process)  # graceful: the master stops its workers
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def cleanup_logs(self) -> None:
        if os.environ.get(KEEP_LOGS_ENV) == "1":
            return
        with contextlib.suppress(OSError):
            self.log_path.unlink(missing_ok=True)
            self.log_dir.rmdir()

    # -- the server's output ----------------------------------------------------------

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_offset(self) -> int:
        try:
            return self.log_path.stat().st_size
        except FileNotFoundError:
            return 0

    def log_since(self, offset: int) -> str:
        try:
            with self.log_path.open("rb") as log:
                log.seek(offset)
                return log.read().decode(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def problems_since(self, offset: int) -> list[str]:
        """Log lines since ``offset`` that no healthy run prints."""
        pattern = re.compile(
            r"Traceback|\[ERROR\]|\[CRITICAL\]|WORKER TIMEOUT|Stale owner|"
            r"store unreachable|Could not release|Internal Server Error"
        )
        return [line for line in self.log_since(offset).splitlines() if pattern.search(line)]

    def diagnostics(self, lines: int = 60) -> str:
        return (
            f"--- gunicorn log {self.log_path} (last {lines} lines) ---\n"
            f"{self.log_tail(lines)}\n--- end of log ---"
        )


@contextlib.contextmanager
def live_server(
    server_url: str | None = None,
    workers: int = WORKERS,
    app: str | None = None,
    extra_env: Mapping[str, str] | None = None,
    project: Project = TESTS_PROJECT,
    extra_args: Sequence[str] = (),
) -> Iterator[LiveServer]:
    """A migrated fresh database and gunicorn in front of it; both gone afterwards."""
    with live_database(server_url) as database:
        server = LiveServer(
            database,
            workers=workers,
            app=app,
            extra_env=extra_env,
            project=project,
            extra_args=extra_args,
        )
        ok = False
        try:
            server.migrate()
            server.start()
            yield server
            ok = True
        finally:
            server.stop()
            database.close_connection()
            if ok:
                server.cleanup_logs()
            else:
                print(f"\nlive server log kept at {server.log_path}", file=sys.stderr)


#: A MariaDB server (``mysql://...``) for the live servers instead of PostgreSQL:
#: set by the matrix's MariaDB live cell (tests/configurations/).
LIVE_MARIADB_URL_ENV = "IDEMPOTENCY_TEST_LIVE_MARIADB_URL"


def lazy_live_server(workers: int = WORKERS) -> Lazy[LiveServer]:
    """One ``live_server()`` started on the first ``get()`` (which needs PostgreSQL)."""
    mariadb = os.environ.get(LIVE_MARIADB_URL_ENV)
    if mariadb:
        return Lazy(lambda: live_server(mariadb, workers), lambda: None)
    return Lazy(lambda: live_server(require_postgres(), workers), require_postgres)


# -- concurrent requests ------------------------------------------------------------------


@dataclass
class Result:
    """One request's answer (or the exception that replaced it)."""

    index: int
    status: int | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    body: bytes = b""
    error: str | None = None
    started: float = 0.0
    elapsed: float = 0.0

    @property
    def replayed(self) -> bool:
        return self.headers.get("Idempotent-Replayed") == "true"

    def describe(self, body_chars: int = 300) -> str:
        if self.error is not None:
            return f"#{self.index}: EXCEPTION {self.error}"
        interesting = {
            name: value
            for name, value in self.headers.items()
            if name.lower()
            in {"content-type", "location", "idempotency-key", "idempotent-replayed", "retry-after"}
        }
        return (
            f"#{self.index}: {self.status} in {self.elapsed:.3f}s {interesting} "
            f"{self.body[:body_chars]!r}"
        )


@dataclass(frozen=True)
class Call:
    url: str
    json: Any
    headers: Mapping[str, str]
    method: str = "POST"
    #: Sent as the body instead of ``json``: bytes a signature was computed over.
    data: bytes | None = None


def fire_together(calls: Sequence[Call], timeout: float = 30.0) -> list[Result]:
    """Send every call at the same instant: one thread and one Session each."""
    results = [Result(index=i) for i in range(len(calls))]
    barrier = threading.Barrier(len(calls), timeout=timeout)

    def run(i: int, call: Call) -> None:
        result = results[i]
        try:
            with requests.Session() as session:
                barrier.wait()
                result.started = time.monotonic()
                response = session.request(
                    call.method,
                    call.url,
                    json=call.json if call.data is None else None,
                    data=call.data,
                    headers=dict(call.headers),
                    timeout=timeout,
                )
                result.elapsed = time.monotonic() - result.started
                result.status = response.status_code
                result.headers = response.headers
                result.body = response.content
                response.close()
        except BaseException as exc:  # reported, never lost in a thread
            result.error = f"{type(exc).__name__}: {exc}"

    threads = [
        threading.Thread(target=run, args=(i, call), name=f"storm-{i}", daemon=True)
        for i, call in enumerate(calls)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout + 10)
    for thread, result in zip(threads, results, strict=True):
        if thread.is_alive() and result.error is None and result.status is None:
            result.error = "thread still running after the timeout"
    return results


def post(url: str, json: Any, headers: Mapping[str, str], timeout: float = 30.0) -> Result:
    """One request on its own connection, as a ``Result``."""
    return fire_together([Call(url, json, headers)], timeout=timeout)[0]
