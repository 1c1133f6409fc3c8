"""A real Prometheus server for the tests, and its tools (Debian's ``prometheus`` package).

``require_binary("promtool")`` finds a tool, skipping the test when it is
missing (failing it with ``IDEMPOTENCY_REQUIRE_SERVICES=1``, as in CI).

``PrometheusServer`` runs ``prometheus`` on a free local port with a storage
directory of its own, scraping one target every second, and answers PromQL
queries over the HTTP API (``/api/v1/query``), as Grafana and the alert
rules read it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.live.processes import BackgroundProcess
from tests.live.server import KEEP_LOGS_ENV, REPO_ROOT, free_port
from tests.live.services import REQUIRE_SERVICES_ENV, services_required

STARTUP_TIMEOUT = 60.0


def require_binary(name: str) -> str:
    """The path of ``name`` (``prometheus`` or ``promtool``); else skip or fail the test."""
    found = shutil.which(name)
    if found is not None:
        return found
    reason = f"{name} is not installed (Debian package `prometheus`)"
    if services_required():
        pytest.fail(f"{name} is required ({REQUIRE_SERVICES_ENV}=1): {reason}", pytrace=False)
    pytest.skip(f"{reason}; set {REQUIRE_SERVICES_ENV}=1 to make this a failure")
    raise AssertionError("unreachable: skip raises")  # pragma: no cover


class PrometheusServer(BackgroundProcess):
    """``prometheus`` scraping ``target`` (``host:port``) at ``metrics_path`` every second."""

    name = "prometheus"

    def __init__(
        self,
        target: str,
        metrics_path: str = "/metrics",
        job: str = "app",
        rule_files: Sequence[Path] = (),
    ) -> None:
        self.binary = require_binary("prometheus")  # before anything needs removing
        self.work_dir = Path(tempfile.mkdtemp(prefix="idem-prometheus-"))
        super().__init__(self.work_dir)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.job = job
        self.config_path = self.work_dir / "prometheus.yml"
        # Every second, so that the test waits seconds, not the default minute.
        # JSON is YAML: no YAML writer needed.
        config = {
            "global": {
                "scrape_interval": "1s",
                "scrape_timeout": "1s",
                "evaluation_interval": "1s",
            },
            "rule_files": [str(path) for path in rule_files],
            "scrape_configs": [
                {
                    "job_name": job,
                    "metrics_path": metrics_path,
                    "static_configs": [{"targets": [target]}],
                }
            ],
        }
        self.config_path.write_text(json.dumps(config, indent=2))

    def __enter__(self) -> PrometheusServer:
        try:
            self.start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
        if os.environ.get(KEEP_LOGS_ENV) == "1":
            print(f"\nprometheus files kept in {self.work_dir}")
        else:
            shutil.rmtree(self.work_dir, ignore_errors=True)

    def start(self) -> None:
        command = [
            self.binary,
            f"--config.file={self.config_path}",
            f"--storage.tsdb.path={self.work_dir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            # The Debian build serves its console templates from /etc; none needed.
            f"--web.console.templates={self.work_dir}",
            f"--web.console.libraries={self.work_dir}",
            "--log.level=info",
        ]
        self._spawn(command, dict(os.environ), REPO_ROOT)
        self.wait_until(self._ready, "answered /-/ready")

    def _ready(self) -> bool:
        with contextlib.suppress(requests.RequestException):
            return requests.get(f"{self.url}/-/ready", timeout=1).status_code == 200
        return False

    def wait_until(
        self, condition: Callable[[], bool], what: str, timeout: float = STARTUP_TIMEOUT
    ) -> None:
        """Poll ``condition`` while Prometheus runs; a RuntimeError after ``timeout``."""

        def running_and_true() -> bool:
            self._check_alive()
            return condition()

        poll(running_and_true, f"prometheus never {what}", timeout, self.diagnostics)

    # -- the HTTP API ----------------------------------------------------------------------

    def api(self, path: str, **params: str) -> Any:
        """``GET /api/v1/<path>``'s ``data``; a RuntimeError when the status is not success."""
        response = requests.get(f"{self.url}/api/v1/{path}", params=params, timeout=10)
        body = response.json()
        if body.get("status") != "success":
            raise RuntimeError(f"{path} {params}: {body}")
        return body["data"]

    def query(self, promql: str) -> list[dict[str, Any]]:
        """An instant query's result vector (``metric`` labels and ``value``)."""
        data = self.api("query", query=promql)
        assert data["resultType"] == "vector", data
        result: list[dict[str, Any]] = data["result"]
        return result

    def scalar(self, promql: str) -> float | None:
        """The single value of an instant query, or None when the vector is empty."""
        result = self.query(promql)
        if not result:
            return None
        assert len(result) == 1, f"{promql} gave {len(result)} series: {result}"
        return float(result[0]["value"][1])

    def last_scrape(self) -> float:
        """When the target was last scraped successfully (unix time), or 0."""
        targets = self.api("targets", state="active")["activeTargets"]
        for target in targets:
            if target["labels"].get("job") == self.job and target["health"] == "up":
                return _unix_time(target["lastScrape"])
        return 0.0

    def wait_for_scrapes_after(self, moment: float, scrapes: int = 2) -> None:
        """Wait until ``scrapes`` scrapes began after ``moment`` (unix time).

        The second one began after the first had been stored, so a query
        then sees a sample taken after ``moment``.
        """
        seen: list[float] = []

        def scraped() -> bool:
            last = self.last_scrape()
            if last > moment and last not in seen:
                seen.append(last)
            return len(seen) >= scrapes

        self.wait_until(scraped, f"scraped {scrapes} times after {moment:.3f}", timeout=30)


def poll(
    condition: Callable[[], bool],
    failure: str,
    timeout: float,
    diagnostics: Callable[[], str] = str,
) -> None:
    """Call ``condition`` until it is true; a RuntimeError saying ``failure`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.2)
    raise RuntimeError(f"{failure} within {timeout:.0f}s.\n{diagnostics()}")


def _unix_time(rfc3339: str) -> float:
    """Prometheus's ``lastScrape`` (RFC 3339, nanoseconds) as unix time."""
    # Python reads at most microseconds.
    return datetime.fromisoformat(re.sub(r"(\.\d{6})\d+", r"\1", rfc3339)).timestamp()
