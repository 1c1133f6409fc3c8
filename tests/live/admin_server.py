"""The demo project (testproject) live, for the admin's browser tests.

``admin_live_server()`` puts together, every part its own process:

- a fresh PostgreSQL database (``LiveDatabase``), migrated and seeded with
  ``manage.py seed_demo`` (alice and bob with their fixed API tokens, the
  superuser admin/admin);
- the payment provider simulator (``ProviderProcess``), whose failure modes
  the API's clients may choose (``X-Simulate``), so that stuck records arise
  as they do in production: a provider that fails or hangs up mid-charge;
- gunicorn serving ``tests.live.admin_wsgi`` (the demo project with its
  static files) with a short idempotency lease, so that a record left
  UNCERTAIN is stuck (its lease run out) within seconds.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

from tests.live.processes import ProviderProcess, demo_project_started, payments_environment
from tests.live.server import REPO_ROOT, LiveDatabase, LiveServer, Project
from tests.live.services import require_postgres

ADMIN_PROJECT = Project(
    settings="testproject.settings",
    app="tests.live.admin_wsgi:application",
    pythonpath=(REPO_ROOT / "testproject",),
    ready_path="/admin/login/",
    ready_statuses=(200,),
)
#: The browser sends one request at a time; two workers are plenty.
WORKERS = 2
#: Seconds: short, so that a record the API left UNCERTAIN is soon stuck.
LEASE = 2.0


@dataclass
class AdminSite:
    database: LiveDatabase
    provider: ProviderProcess
    server: LiveServer

    @property
    def url(self) -> str:
        return self.server.url

    def api(
        self,
        method: str,
        path: str,
        token: str,
        key: str | None,
        body: Any,
        headers: Mapping[str, str] | None = None,
    ) -> requests.Response:
        """One call to the demo API, as a client makes it."""
        sent = {"Authorization": f"Token {token}", **(headers or {})}
        if key is not None:
            sent["Idempotency-Key"] = key
        response = requests.request(method, self.url + path, json=body, headers=sent, timeout=30)
        response.close()
        return response

    def diagnostics(self) -> str:
        return "\n".join([self.server.diagnostics(), self.provider.diagnostics()])


@contextlib.contextmanager
def admin_live_server(
    server_url: str | None = None, extra_env: Mapping[str, str] | None = None
) -> Iterator[AdminSite]:
    """Database, provider simulator and gunicorn (demo project + admin); all gone afterwards."""
    postgres = server_url or require_postgres()
    log_dir = Path(tempfile.mkdtemp(prefix="idem-admin-"))
    with LiveDatabase(postgres, prefix="idem_admin") as database:
        provider = ProviderProcess(log_dir)
        env = payments_environment(provider, lease=LEASE, timeout=5, crash_hooks=False)
        env.update(extra_env or {})
        server = LiveServer(
            database, workers=WORKERS, extra_env=env, project=ADMIN_PROJECT, log_dir=log_dir
        )
        with demo_project_started(database, provider, server, log_dir, "admin live-server"):
            yield AdminSite(database, provider, server)
