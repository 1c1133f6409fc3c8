"""Real Celery processes for the live tests: a Redis broker, workers, beat.

- ``require_redis()``: the broker URL if Redis answers; else the test is
  skipped, or failed under ``IDEMPOTENCY_REQUIRE_SERVICES=1`` (the policy of
  ``tests.live.services``).
- ``redis_db()``: a context manager that flushes these tests' dedicated
  Redis database (``IDEMPOTENCY_TEST_CELERY_REDIS_URL``, default db 12)
  before and after; nothing else on the server is touched. Give that
  database to nothing else. Every test also uses a queue of its own.
- ``celery_database()``: a fresh PostgreSQL database (``LiveDatabase``),
  migrated, dropped afterwards.
- ``CeleryProcess``: ``celery -A tests.live.celery_app worker|beat`` in its
  own process group, its output in a log file; ``stop()`` is a warm
  shutdown, ``kill()`` a SIGKILL of the whole group (main process and pool
  children), ``kill_pid()`` of one pool child.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from tests.live import services
from tests.live.server import REPO_ROOT, LiveDatabase, terminate
from tests.live.services import require_postgres

REDIS_URL_ENV = "IDEMPOTENCY_TEST_CELERY_REDIS_URL"
#: A database of its own on the local Redis, flushed by these tests (the
#: crash tests' broker, IDEMPOTENCY_TEST_REDIS_URL, is another one).
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/12"
SETTINGS = "tests.live.celery_settings"
STARTUP_TIMEOUT = 60.0
STOP_TIMEOUT = 20.0


def redis_url() -> str:
    return os.environ.get(REDIS_URL_ENV) or DEFAULT_REDIS_URL


def require_redis() -> str:
    """These tests' broker URL if Redis answers; else skip the test (fail it in CI)."""
    return services.require_redis(redis_url(), REDIS_URL_ENV)


@contextlib.contextmanager
def redis_db(url: str) -> Iterator[Any]:
    """The tests' dedicated Redis database, flushed before and after (only that one)."""
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=10)
    client.flushdb()
    try:
        yield client
    finally:
        with contextlib.suppress(redis.RedisError):
            client.flushdb()
        client.close()


def migrate(database: LiveDatabase, log_path: Path) -> None:
    command = [sys.executable, "-m", "django", "migrate", "--settings", SETTINGS, "--noinput"]
    result = subprocess.run(
        command,
        cwd=REPO_ROOT,
        env={**os.environ, **database.app_environment(), "DJANGO_SETTINGS_MODULE": SETTINGS},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    with log_path.open("a") as log:
        log.write(f"$ {' '.join(command)}\n{result.stdout}{result.stderr}\n")
    if result.returncode != 0:
        raise RuntimeError(
            f"migrate into {database.name} failed ({result.returncode}):\n"
            f"{result.stdout}\n{result.stderr}"
        )


@contextlib.contextmanager
def celery_database(log_dir: Path) -> Iterator[LiveDatabase]:
    """A fresh, migrated PostgreSQL database; skipped or failed if there is no server."""
    url = require_postgres()
    with LiveDatabase(url, prefix="idem_celery") as database:
        try:
            migrate(database, log_dir / "migrate.log")
            yield database
        finally:
            database.close_connection()


def celery_environment(
    database: LiveDatabase, broker: str, queue: str, **extra: str
) -> dict[str, str]:
    env = dict(os.environ)
    env.update(database.app_environment())
    env.update(
        DJANGO_SETTINGS_MODULE=SETTINGS,
        IDEMPOTENCY_TEST_BROKER_URL=broker,
        IDEMPOTENCY_TEST_CELERY_QUEUE=queue,
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


def new_queue() -> str:
    return f"idem-live-{uuid.uuid4().hex[:10]}"


class QueueClient:
    """Sends tasks to one worker's queue from the test process and waits for their results.

    ``close()`` deletes the queue's keys (the Redis database is shared with
    other tests) and the result backend's pub/sub and pooled sockets, which
    otherwise leak.
    """

    def __init__(self, broker: str, queue: str, name: str = "idem-live-client") -> None:
        self.broker = broker
        self.queue = queue
        self.name = name
        self._app: Any = None

    @property
    def app(self) -> Any:
        if self._app is None:
            from celery import Celery

            self._app = Celery(
                self.name, broker=self.broker, backend=self.broker, set_as_current=False
            )
            self._app.conf.broker_connection_retry_on_startup = True
        return self._app

    def run(self, task: str, timeout: float = 60.0, **kwargs: Any) -> Any:
        """Send ``task`` to the queue and wait for its result (its error is raised)."""
        result = self.app.send_task(task, kwargs=kwargs, queue=self.queue)
        try:
            return result.get(timeout=timeout, propagate=True)
        finally:
            result.forget()

    def close(self) -> None:
        app, self._app = self._app, None
        if app is None:
            return
        with contextlib.suppress(Exception), app.connection_for_write() as connection:
            connection.default_channel.client.delete(
                self.queue,
                f"_kombu.binding.{self.queue}",
                f"_kombu.binding_permanent.{self.queue}",
            )
        backend = app.backend
        with contextlib.suppress(Exception):
            backend.result_consumer.stop()
        with contextlib.suppress(Exception):
            backend.client.connection_pool.disconnect()
        app.close()


class CeleryProcess:
    """``celery -A tests.live.celery_app <kind>`` with its output in ``log_path``."""

    def __init__(self, kind: str, args: list[str], env: Mapping[str, str], log_path: Path) -> None:
        self.kind = kind
        self.command = [sys.executable, "-m", "celery", "-A", "tests.live.celery_app", kind, *args]
        self.env = dict(env)
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None
        self._log: Any = None

    @classmethod
    def worker(cls, env: Mapping[str, str], log_path: Path, concurrency: int = 2) -> CeleryProcess:
        name = f"live-{uuid.uuid4().hex[:8]}@%h"
        args = [
            "--loglevel=INFO",
            "--pool=prefork",
            f"--concurrency={concurrency}",
            "-n", name,
            "-Q", env["IDEMPOTENCY_TEST_CELERY_QUEUE"],
            "--without-gossip", "--without-mingle", "--without-heartbeat",
        ]  # fmt: skip
        return cls("worker", args, env, log_path)

    @classmethod
    def beat(cls, env: Mapping[str, str], log_path: Path, state_dir: Path) -> CeleryProcess:
        args = [
            "--loglevel=INFO",
            "--schedule", str(state_dir / "celerybeat-schedule"),
            "--pidfile", str(state_dir / "celerybeat.pid"),
            "--max-interval", "1",
        ]  # fmt: skip
        return cls("beat", args, env, log_path)

    # -- lifecycle -----------------------------------------------------------------------

    def start(self, ready: str | None = None) -> CeleryProcess:
        """Start; with ``ready``, wait until the log matches that pattern."""
        self._log = self.log_path.open("ab")
        self._log.write(f"$ {' '.join(self.command)}\n".encode())
        self._log.flush()
        self.process = subprocess.Popen(
            self.command,
            cwd=REPO_ROOT,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: kill() takes the children too
        )
        if ready is not None:
            self.wait_for_log(ready, timeout=STARTUP_TIMEOUT)
        return self

    def start_worker(self) -> CeleryProcess:
        return self.start(ready=r"\] \S+@\S+ ready\.")

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def stop(self) -> None:
        """Warm shutdown (SIGTERM); SIGKILL the group if it does not go in time."""
        process, self.process = self.process, None
        if process is not None:
            terminate(process, STOP_TIMEOUT)
        # Pool children left behind by a crashed main process.
        if process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        self._close_log()

    def kill(self) -> None:
        """SIGKILL the main process and its pool children at once: a machine dying."""
        process, self.process = self.process, None
        if process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=STOP_TIMEOUT)
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    # -- output --------------------------------------------------------------------------

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def wait_for_log(self, pattern: str, timeout: float, count: int = 1) -> str:
        deadline = time.monotonic() + timeout
        regex = re.compile(pattern)
        while time.monotonic() < deadline:
            text = self.log_text()
            if len(regex.findall(text)) >= count:
                return text
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(
                    f"celery {self.kind} exited with {self.process.returncode}.\n"
                    + self.diagnostics()
                )
            time.sleep(0.1)
        raise RuntimeError(
            f"celery {self.kind}: {count} x {pattern!r} not in its log within {timeout:.0f}s.\n"
            + self.diagnostics()
        )

    def diagnostics(self, lines: int = 80) -> str:
        tail = "\n".join(self.log_text().splitlines()[-lines:])
        return f"--- celery {self.kind} log {self.log_path} (last {lines} lines) ---\n{tail}\n---"


def wait_until(
    condition: Callable[[], bool], timeout: float, describe: Callable[[], str], step: float = 0.2
) -> None:
    """Poll ``condition`` until true; else fail with ``describe()``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(step)
    if condition():
        return
    raise AssertionError(f"not within {timeout:.0f}s:\n{describe()}")
