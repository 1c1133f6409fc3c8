"""More real processes for the live tests: the provider simulator and a Celery worker.

``payments_stack()`` puts together what the crash tests run against, every
part its own process, as in production:

- a fresh PostgreSQL database (``LiveDatabase``), migrated and seeded with
  the demo users (``manage.py seed_demo``: alice and bob, fixed tokens);
- the payment provider simulator (``testproject/provider/server.py``) with
  a ledger file of its own (``ProviderProcess``);
- gunicorn serving the demo project (``LiveServer`` with
  ``PAYMENTS_PROJECT``), with a short idempotency lease, the simulator's
  failure modes passed through and, optionally, the crash hooks on;
- ``celery -A testproject worker --pool=solo`` on a Redis broker, consuming
  a queue named for this run only, so that concurrent runs (or other Celery
  tests on the same Redis database) never take each other's tasks
  (``CeleryWorker``). ``CeleryWorker.run()`` sends a task by name and waits
  for its result, as a beat-scheduled run would be executed.

Logs go to a temporary directory; ``diagnostics()`` quotes their tails.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from tests.live.celery_harness import QueueClient
from tests.live.server import (
    KEEP_LOGS_ENV,
    PAYMENTS_PROJECT,
    REPO_ROOT,
    Lazy,
    LiveDatabase,
    LiveServer,
    free_port,
    terminate,
)
from tests.live.services import require_postgres, require_redis

PROVIDER_SCRIPT = REPO_ROOT / "testproject" / "provider" / "server.py"
#: Lines printed in pytest's terminal summary (by ``tests/live/conftest.py``),
#: such as the crash tests' table: visible without ``-s``.
summary_lines: list[str] = []
STARTUP_TIMEOUT = 60.0
STOP_TIMEOUT = 15.0


class BackgroundProcess:
    """A child process in its own session, its output in a log file."""

    name = "process"

    def __init__(self, log_dir: Path) -> None:
        self.log_path = log_dir / f"{self.name}.log"
        self.process: subprocess.Popen[bytes] | None = None
        self._log_file: Any = None

    def _spawn(self, command: Sequence[str], env: Mapping[str, str], cwd: Path) -> None:
        self._log_file = self.log_path.open("ab")
        self._log_file.write(f"$ {' '.join(command)}\n".encode())
        self._log_file.flush()
        self.process = subprocess.Popen(
            list(command),
            cwd=cwd,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def _check_alive(self) -> None:
        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(
                f"{self.name} exited with {self.process.returncode}.\n" + self.diagnostics()
            )

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is not None:
            terminate(process, STOP_TIMEOUT)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def diagnostics(self, lines: int = 40) -> str:
        tail = "\n".join(self.log_text().splitlines()[-lines:])
        return f"--- {self.name} log {self.log_path} (last {lines} lines) ---\n{tail}\n--- end ---"


class ProviderProcess(BackgroundProcess):
    """``testproject/provider/server.py`` on a free port with its own ledger file."""

    name = "provider"

    def __init__(self, log_dir: Path, host: str = "127.0.0.1") -> None:
        super().__init__(log_dir)
        self.ledger_path = log_dir / "provider-ledger.sqlite3"
        self.host = host
        self.port = free_port()
        self.url = f"http://{host}:{self.port}"

    def start(self) -> None:
        command = [
            sys.executable, str(PROVIDER_SCRIPT),
            "--host", self.host, "--port", str(self.port), "--ledger", str(self.ledger_path),
        ]  # fmt: skip
        self._spawn(command, {**os.environ, "PYTHONUNBUFFERED": "1"}, REPO_ROOT)
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            self._check_alive()
            with contextlib.suppress(requests.RequestException):
                if requests.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            time.sleep(0.05)
        raise RuntimeError("the provider simulator did not answer.\n" + self.diagnostics())

    def ledger(self) -> list[dict[str, Any]]:
        """Every charge in the provider's ledger, oldest first."""
        response = requests.get(f"{self.url}/ledger", timeout=10)
        response.raise_for_status()
        charges: list[dict[str, Any]] = response.json()["charges"]
        return charges

    def charges_by_order(self) -> dict[str, list[dict[str, Any]]]:
        """The ledger grouped by the order id the payments view sent as metadata."""
        grouped: dict[str, list[dict[str, Any]]] = {}
        for charge in self.ledger():
            grouped.setdefault(str(charge["metadata"].get("order_id")), []).append(charge)
        return grouped


class CeleryWorker(BackgroundProcess):
    """``celery -A testproject worker --pool=solo`` on a queue of its own."""

    name = "celery-worker"

    def __init__(self, log_dir: Path, broker_url: str, env: Mapping[str, str]) -> None:
        super().__init__(log_dir)
        self.broker_url = broker_url
        self.queue = f"idem-live-{uuid.uuid4().hex[:10]}"
        self.env = {
            **env,
            "CELERY_BROKER_URL": broker_url,
            "CELERY_RESULT_BACKEND": broker_url,
            "CELERY_TASK_DEFAULT_QUEUE": self.queue,
            "PYTHONUNBUFFERED": "1",
        }
        self.tasks = QueueClient(broker_url, self.queue)

    def start(self) -> None:
        command = [
            sys.executable, "-m", "celery", "-A", "testproject", "worker",
            "--pool=solo", "--concurrency=1", "--loglevel=INFO",
            "-Q", self.queue, "-n", f"{self.queue}@%h",
            "--without-gossip", "--without-mingle", "--without-heartbeat",
        ]  # fmt: skip
        self._spawn(command, self.env, REPO_ROOT / "testproject")
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            self._check_alive()
            if " ready." in self.log_text():
                return
            time.sleep(0.1)
        raise RuntimeError("the Celery worker did not become ready.\n" + self.diagnostics())

    def run(self, task: str, timeout: float = 60.0, **kwargs: Any) -> Any:
        """Send ``task`` to this worker's queue and wait for its result."""
        return self.tasks.run(task, timeout, **kwargs)

    def stop(self) -> None:
        super().stop()
        self.tasks.close()


@dataclass
class PaymentsStack:
    database: LiveDatabase
    provider: ProviderProcess
    server: LiveServer
    worker: CeleryWorker
    lease: float
    log_dir: Path
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        return self.server.url

    def recover(self, batch_size: int = 500) -> dict[str, int]:
        """One ``recover_stale_records`` run in the real Celery worker; its report.

        Serialised: the worker runs one task at a time anyway, and the
        client's result backend is not meant to be shared by threads.
        """
        with self._lock:
            report: dict[str, int] = self.worker.run(
                "django_idempotency.tasks.recover_stale_records", batch_size=batch_size
            )
        return report

    def diagnostics(self) -> str:
        return "\n".join(
            [self.server.diagnostics(), self.provider.diagnostics(), self.worker.diagnostics()]
        )


def payments_environment(
    provider: ProviderProcess, *, lease: float, timeout: float, crash_hooks: bool
) -> dict[str, str]:
    """The demo project's settings for a live run against the provider simulator."""
    return {
        "IDEMPOTENCY_LEASE": str(lease),
        "PAYMENTS_PROVIDER_URL": provider.url,
        "PAYMENTS_PROVIDER_TIMEOUT": str(timeout),
        "PAYMENTS_PROVIDER_SIMULATION": "1",
        "PAYMENTS_CRASH_HOOKS": "1" if crash_hooks else "0",
    }


@contextlib.contextmanager
def payments_stack(
    *,
    workers: int = 4,
    lease: float = 2.0,
    provider_timeout: float = 6.0,
    crash_hooks: bool = True,
    extra_env: Mapping[str, str] | None = None,
) -> Iterator[PaymentsStack]:
    """Database, provider, gunicorn (demo project) and a Celery worker; all gone afterwards.

    gunicorn runs with ``--preload``: a worker killed by a crash test is
    replaced by a fork of the loaded master in milliseconds, not a fresh
    Django start-up.
    """
    postgres = require_postgres()
    broker = require_redis()
    log_dir = Path(tempfile.mkdtemp(prefix="idem-crash-"))
    with LiveDatabase(postgres, prefix="idem_crash") as database:
        provider = ProviderProcess(log_dir)
        env = payments_environment(
            provider, lease=lease, timeout=provider_timeout, crash_hooks=crash_hooks
        )
        env.update(extra_env or {})
        server = LiveServer(
            database,
            workers=workers,
            extra_env=env,
            project=PAYMENTS_PROJECT,
            extra_args=["--preload"],
            log_dir=log_dir,
        )
        worker = CeleryWorker(log_dir, broker, server.environment())
        with demo_project_started(database, provider, server, log_dir, "crash-test"):
            try:
                worker.start()
                yield PaymentsStack(database, provider, server, worker, lease, log_dir)
            finally:
                worker.stop()


@contextlib.contextmanager
def demo_project_started(
    database: LiveDatabase,
    provider: ProviderProcess,
    server: LiveServer,
    log_dir: Path,
    label: str,
) -> Iterator[None]:
    """The provider simulator and the migrated, seeded demo project under gunicorn.

    Stopped afterwards; ``log_dir`` is removed, or kept (and named) when the
    block failed or ``IDEMPOTENCY_LIVE_KEEP_LOGS=1``.
    """
    ok = False
    try:
        provider.start()
        server.migrate()
        server.manage("seed_demo")
        server.start()
        yield
        ok = True
    finally:
        server.stop()
        provider.stop()
        database.close_connection()
        if ok and os.environ.get(KEEP_LOGS_ENV) != "1":
            shutil.rmtree(log_dir, ignore_errors=True)
        else:
            print(f"\n{label} logs kept in {log_dir}", file=sys.stderr)


def require_payments_services() -> None:
    require_postgres()
    require_redis()


def lazy_payments_stack(**options: Any) -> Lazy[PaymentsStack]:
    """One ``payments_stack()`` started on the first ``get()`` (PostgreSQL and Redis needed)."""
    return Lazy(lambda: payments_stack(**options), require_payments_services)
