"""``async def`` views, Django's and adrf's, under a real ASGI server (uvicorn) on PostgreSQL."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.live.server import REPO_ROOT, LiveDatabase, free_port
from tests.live.services import require_postgres

pytestmark = [pytest.mark.postgres, pytest.mark.live]


@pytest.fixture(scope="module")
def uvicorn_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, LiveDatabase]]:
    require_postgres()
    log = tmp_path_factory.mktemp("uvicorn") / "uvicorn.log"
    with LiveDatabase() as database:
        env = {
            **os.environ,
            "DATABASE_URL": database.url,
            "DJANGO_SETTINGS_MODULE": "tests.settings",
        }
        subprocess.run(
            [sys.executable, "-m", "django", "migrate", "-v", "0"],
            cwd=REPO_ROOT,
            env=env,
            check=True,
        )
        port = free_port()
        with log.open("w") as output:
            process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "uvicorn",
                    "tests.live.asgi:application",
                    "--port",
                    str(port),
                    "--workers",
                    "2",
                    "--log-level",
                    "warning",
                ],
                cwd=REPO_ROOT,
                env=env,
                stdout=output,
                stderr=subprocess.STDOUT,
            )
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_until_ready(url, process, log)
            yield url, database
        finally:
            process.terminate()
            process.wait(timeout=20)
            database.close_connection()


def _wait_until_ready(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"uvicorn exited with {process.returncode}:\n{log.read_text()}")
        try:
            requests.get(url + "/async/charges", timeout=1)
            return
        except requests.ConnectionError:
            time.sleep(0.2)
    pytest.fail(f"uvicorn did not start:\n{log.read_text()}")


def post(
    url: str, body: dict[str, Any], key: str | None, path: str = "/async/charges"
) -> requests.Response:
    headers = {} if key is None else {"Idempotency-Key": key}
    return requests.post(url + path, json=body, headers=headers, timeout=30)


def test_the_behaviour_table_under_uvicorn(uvicorn_server: tuple[str, LiveDatabase]) -> None:
    url, database = uvicorn_server
    first = post(url, {"amount": 5, "note": "table"}, "table-1")
    retry = post(url, {"amount": 5, "note": "table"}, "table-1")
    mismatch = post(url, {"amount": 6, "note": "table"}, "table-1")
    missing = post(url, {"amount": 5, "note": "table"}, None)
    invalid = post(url, {"amount": 5, "note": "table"}, "bad key")
    released = post(url, {"amount": 5, "note": "table", "status": 503}, "table-2")
    failed = post(url, {"amount": 5, "note": "table", "status": 404}, "table-3")
    failed_again = post(url, {"amount": 5, "note": "table", "status": 404}, "table-3")

    assert first.status_code == 201 and first.headers["Idempotency-Key"] == "table-1"
    assert retry.content == first.content and retry.headers["Idempotent-Replayed"] == "true"
    assert mismatch.json()["code"] == "idempotency_key_reused"
    assert missing.json()["code"] == "idempotency_key_missing"
    assert invalid.json()["code"] == "idempotency_key_invalid"
    assert released.status_code == 503 and database.count_records("table-2") == 0
    assert failed_again.content == failed.content
    assert failed_again.headers["Idempotent-Replayed"] == "true"
    # table-1 once, table-3 once (a stored 404 commits its write); the 503 rolled back.
    assert database.count_charges("table") == 2


@pytest.mark.parametrize(
    "path",
    ["/async/charges", "/adrf/mixin", "/adrf/function"],
    ids=["django", "adrf-mixin", "adrf-api-view"],
)
def test_concurrent_duplicates_run_an_async_view_once(
    uvicorn_server: tuple[str, LiveDatabase], path: str
) -> None:
    url, database = uvicorn_server
    for round_number in range(5):
        note = f"storm-{path}-{round_number}"
        barrier = threading.Barrier(20)
        statuses: list[int] = []

        def send(
            note: str = note, barrier: threading.Barrier = barrier, statuses: list[int] = statuses
        ) -> None:
            barrier.wait()
            body = {"amount": 1, "note": note, "sleep": 0.2}
            statuses.append(post(url, body, note, path).status_code)

        threads = [threading.Thread(target=send) for _ in range(20)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

        assert database.count_charges(note) == 1
        assert set(statuses) <= {201, 409}, statuses
