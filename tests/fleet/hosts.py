"""The fleet's processes: shared services on the bridge, and three hosts running the app.

``fleet()`` is a context manager giving a ``Fleet``:

- ``FleetNetwork`` (``tests/fleet/network.py``): the bridge and the hosts'
  namespaces;
- on the bridge address, shared by the hosts: a PostgreSQL server of the
  test's own (``OwnPostgres``, listening on the bridge too, trusting the
  hosts' subnet, with server-side TCP keepalives and
  ``idle_in_transaction_session_timeout`` so that it drops a cut-off
  host's backends), a Redis server of its own (the Celery broker; no
  persistence), and the provider simulator (``ProviderProcess``);
- the demo project migrated and seeded, plus one user (and token) per
  client, so that clients do not queue on each other's row lock;
- on every host (``FleetHost``), under the host's own hostname: gunicorn
  serving the payments API on the host's address, a Celery worker and,
  deliberately, a ``celery beat`` of its own (``fleet_settings``: recovery
  and purge every second). ``kill()`` is ``kill -9`` of every process in
  the namespace; ``start()`` brings them back.

Everything is stopped and removed on exit, also when the test failed; the
logs are kept (and named) when it failed or ``IDEMPOTENCY_LIVE_KEEP_LOGS=1``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import requests

from tests.fleet.network import FleetNetwork, Host, missing, require_namespaces
from tests.live.own_postgres import OwnPostgres
from tests.live.processes import BackgroundProcess, CeleryWorker, ProviderProcess
from tests.live.server import KEEP_LOGS_ENV, PAYMENTS_PROJECT, REPO_ROOT, free_port

SETTINGS = "tests.fleet.fleet_settings"
APP_PORT = 8000
GUNICORN_WORKERS = 3
STARTUP_TIMEOUT = 90.0
#: The idempotency lease on the hosts (seconds): longer than the provider's
#: slow answers, so recovery never asks the provider about a call still running.
LEASE = 5.0
#: How long a host's view waits for the provider (seconds).
PROVIDER_TIMEOUT = 15.0
BEAT_INTERVAL = 1.0

#: The server's side of the partition bounds (postgresql.conf names): a
#: dead client's backend is dropped after about idle + interval x count
#: seconds of silence (or tcp_user_timeout of unacknowledged data), or when
#: idle in a transaction for longer than idle_in_transaction_session_timeout.
SERVER_SETTINGS: dict[str, int | str] = {
    "tcp_keepalives_idle": 10,
    "tcp_keepalives_interval": 2,
    "tcp_keepalives_count": 3,
    "idle_in_transaction_session_timeout": "30s",
    # Keepalives only probe an idle connection: if the cut came before the
    # host acknowledged the server's last answer, the server retransmits
    # instead, for minutes, unless this bounds it (milliseconds).
    "tcp_user_timeout": 16000,
}
#: The hosts' libpq side (DATABASES["default"]["OPTIONS"] in fleet_settings).
CLIENT_SETTINGS = {
    "FLEET_PG_CONNECT_TIMEOUT": "3",
    "FLEET_PG_KEEPALIVES_IDLE": "10",
    "FLEET_PG_KEEPALIVES_INTERVAL": "2",
    "FLEET_PG_KEEPALIVES_COUNT": "3",
    "FLEET_PG_TCP_USER_TIMEOUT_MS": "20000",
}


def require_fleet() -> None:
    """Skip (or fail, under IDEMPOTENCY_REQUIRE_SERVICES=1) without namespaces, nginx, redis."""
    require_namespaces()
    for tool in ("nginx", "redis-server"):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            missing(tool, "not installed")


class BridgePostgres(OwnPostgres):
    """``OwnPostgres`` also listening on the bridge, trusting the hosts' subnet."""

    def __init__(self, address: str, subnet: str, settings: Sequence[str]) -> None:
        # The later listen_addresses overrides OwnPostgres's 127.0.0.1.
        super().__init__(
            label="fleet", settings=[f"listen_addresses=127.0.0.1,{address}", *settings]
        )
        self.address = address
        self.subnet = subnet

    def _make_data_dir(self) -> None:
        super()._make_data_dir()
        with (self.data_dir / "pg_hba.conf").open("a") as hba:
            hba.write(f"host all all {self.subnet} trust\n")


class RedisServer(BackgroundProcess):
    """``redis-server`` of the test's own on the bridge: the fleet's Celery broker."""

    name = "redis"

    def __init__(self, log_dir: Path, address: str) -> None:
        super().__init__(log_dir)
        self.port = free_port()
        self.url = f"redis://{address}:{self.port}/0"
        self.address = address

    def start(self) -> None:
        command = [
            shutil.which("redis-server") or "redis-server",
            "--port", str(self.port), "--bind", self.address,
            "--save", "", "--appendonly", "no", "--protected-mode", "no",
            "--dir", str(self.log_path.parent),
        ]  # fmt: skip
        self._spawn(command, os.environ, self.log_path.parent)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            self._check_alive()
            if "Ready to accept connections" in self.log_text():
                return
            time.sleep(0.05)
        raise RuntimeError("redis-server did not start.\n" + self.diagnostics())


class OnHost:
    """Mixin: the process runs inside ``self.host``'s namespace, under its hostname."""

    host: Host

    def _spawn(self, command: Sequence[str], env: Mapping[str, str], cwd: Path) -> None:
        super()._spawn([*self.host.run_prefix(), *command], env, cwd)  # type: ignore[misc]


class HostWorker(OnHost, CeleryWorker):
    def __init__(self, host: Host, log_dir: Path, broker_url: str, env: Mapping[str, str]) -> None:
        self.host = host
        super().__init__(log_dir, broker_url, env)


class HostGunicorn(OnHost, BackgroundProcess):
    name = "gunicorn"

    def __init__(self, host: Host, log_dir: Path, env: Mapping[str, str]) -> None:
        super().__init__(log_dir)
        self.host = host
        self.env = dict(env)
        self.url = f"http://{host.address}:{APP_PORT}"

    def start(self) -> None:
        command = [
            sys.executable, "-m", "gunicorn", PAYMENTS_PROJECT.app,
            "-w", str(GUNICORN_WORKERS), "-k", "sync",
            "-b", f"{self.host.address}:{APP_PORT}",
            "--timeout", "60", "--graceful-timeout", "3", "--preload", "--no-control-socket",
            "--access-logfile", "-",
            "--access-logformat", '%(h)s "%(r)s" %(s)s key=%({idempotency-key}i)s %(M)sms',
            "--error-logfile", "-",
        ]  # fmt: skip
        self._spawn(command, self.env, REPO_ROOT)

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            self._check_alive()
            with contextlib.suppress(requests.RequestException):
                if requests.get(self.url + "/v1/payments", timeout=2).status_code == 401:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"gunicorn on {self.host.name} not ready.\n" + self.diagnostics())


class HostBeat(OnHost, BackgroundProcess):
    name = "celery-beat"

    def __init__(self, host: Host, log_dir: Path, env: Mapping[str, str]) -> None:
        super().__init__(log_dir)
        self.host = host
        self.env = dict(env)
        self.state_dir = log_dir

    def start(self) -> None:
        command = [
            sys.executable, "-m", "celery", "-A", "testproject", "beat", "--loglevel=INFO",
            "--schedule", str(self.state_dir / "celerybeat-schedule"),
            "--pidfile", str(self.state_dir / "celerybeat.pid"), "--max-interval", "1",
        ]  # fmt: skip
        self._spawn(command, self.env, REPO_ROOT / "testproject")


@dataclass
class FleetHost:
    host: Host
    gunicorn: HostGunicorn
    worker: HostWorker
    beat: HostBeat

    @property
    def name(self) -> str:
        return self.host.name

    @property
    def url(self) -> str:
        return self.gunicorn.url

    def start(self) -> None:
        self.gunicorn.start()
        self.worker.start()
        self.beat.start()
        self.gunicorn.wait_ready(time.monotonic() + STARTUP_TIMEOUT)

    def kill(self) -> list[int]:
        """``kill -9`` every process of the host (found by namespace, not by our handles)."""
        pids = self.host.kill_everything()
        for process in (self.gunicorn, self.worker, self.beat):
            if process.process is not None:
                process.process.wait(timeout=10)
            process.stop()
        return pids

    def stop(self) -> None:
        for process in (self.beat, self.worker, self.gunicorn):
            with contextlib.suppress(Exception):
                process.stop()

    def processes(self) -> Sequence[BackgroundProcess]:
        return (self.gunicorn, self.worker, self.beat)


@dataclass
class Fleet:
    network: FleetNetwork
    postgres: BridgePostgres
    database_url: str
    redis: RedisServer
    provider: ProviderProcess
    hosts: list[FleetHost]
    log_dir: Path
    audit_log: Path
    #: Per client: (Authorization header value, user id).
    tokens: list[str] = field(default_factory=list)

    def query(self, statement: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.database_url, autocommit=True, connect_timeout=5) as db:
            return db.execute(statement, params).fetchall()

    def admin(self, statement: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """On the server's ``postgres`` database: pg_stat_activity and pg_locks see all."""
        with psycopg.connect(self.postgres.url(), autocommit=True, connect_timeout=5) as db:
            return db.execute(statement, params).fetchall()

    def diagnostics(self) -> str:
        parts = [self.provider.diagnostics(), self.postgres.log_tail()]
        for host in self.hosts:
            parts.extend(process.diagnostics(30) for process in host.processes())
        return "\n".join(parts)


def _seed_clients(env: Mapping[str, str], count: int) -> list[str]:
    """``count`` users with API tokens; returns the tokens (one per client)."""
    script = (
        "from django.contrib.auth.models import User\n"
        "from rest_framework.authtoken.models import Token\n"
        f"for i in range({count}):\n"
        "    user = User.objects.create_user(f'fleet-client-{i}')\n"
        "    print('TOKEN', Token.objects.create(user=user).key)\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "django", "shell", "-c", script, "--settings", SETTINGS],
        cwd=REPO_ROOT,
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return [line.split()[1] for line in result.stdout.splitlines() if line.startswith("TOKEN ")]


def _manage(env: Mapping[str, str], *args: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "django", *args, "--settings", SETTINGS],
        cwd=REPO_ROOT,
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"manage.py {' '.join(args)} failed:\n{result.stdout}{result.stderr}")


@contextlib.contextmanager
def fleet(clients: int = 12) -> Iterator[Fleet]:
    """The network, the shared services and three running hosts; all gone afterwards."""
    require_fleet()
    log_dir = Path(tempfile.mkdtemp(prefix="idem-fleet-"))
    os.chmod(log_dir, 0o755)
    ok = False
    try:
        with contextlib.ExitStack() as stack:
            network = stack.enter_context(FleetNetwork(3))
            server_settings = [f"{name}={value}" for name, value in SERVER_SETTINGS.items()]
            postgres = BridgePostgres(network.gateway, str(network.subnet), server_settings)
            stack.enter_context(postgres)
            database = f"fleet_{network.tag}"
            postgres.create_database(database)
            database_url = f"postgres://postgres@{network.gateway}:{postgres.port}/{database}"
            redis = RedisServer(log_dir, network.gateway)
            stack.callback(redis.stop)
            redis.start()
            provider = ProviderProcess(log_dir, host=network.gateway)
            stack.callback(provider.stop)
            provider.start()
            audit_log = log_dir / "recovery-audit.jsonl"
            paths = [str(path) for path in PAYMENTS_PROJECT.pythonpath]
            env = {
                **os.environ,
                **CLIENT_SETTINGS,
                "DATABASE_URL": database_url,
                "DJANGO_SETTINGS_MODULE": SETTINGS,
                "PYTHONPATH": os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")]),
                "PYTHONUNBUFFERED": "1",
                "IDEMPOTENCY_LEASE": str(LEASE),
                "PAYMENTS_PROVIDER_URL": provider.url,
                "PAYMENTS_PROVIDER_TIMEOUT": str(PROVIDER_TIMEOUT),
                "PAYMENTS_PROVIDER_SIMULATION": "1",
                "PAYMENTS_CRASH_HOOKS": "0",
                "FLEET_BEAT_INTERVAL": str(BEAT_INTERVAL),
                "FLEET_AUDIT_LOG": str(audit_log),
            }
            _manage(env, "migrate", "--noinput")
            tokens = _seed_clients(env, clients)
            hosts = []
            for host in network.hosts:
                host_dir = log_dir / host.name
                host_dir.mkdir()
                worker = HostWorker(host, host_dir, redis.url, env)
                # The beat sends to the queue of its own host's worker.
                beat = HostBeat(host, host_dir, worker.env)
                hosts.append(FleetHost(host, HostGunicorn(host, host_dir, env), worker, beat))
            for fleet_host in hosts:
                stack.callback(fleet_host.stop)
            for fleet_host in hosts:
                fleet_host.gunicorn.start()
                fleet_host.worker.start()
                fleet_host.beat.start()
            for fleet_host in hosts:
                fleet_host.gunicorn.wait_ready(time.monotonic() + STARTUP_TIMEOUT)
            yield Fleet(
                network, postgres, database_url, redis, provider, hosts, log_dir, audit_log, tokens
            )
            ok = True
    finally:
        if ok and os.environ.get(KEEP_LOGS_ENV) != "1":
            shutil.rmtree(log_dir, ignore_errors=True)
        else:
            print(f"\nfleet logs kept in {log_dir}", file=sys.stderr)
