"""single_transaction=True under gunicorn on PostgreSQL: the race and the crash."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
import requests

from tests.live.server import Call, LiveServer, fire_together, live_server
from tests.live.services import require_postgres

pytestmark = [pytest.mark.postgres, pytest.mark.live, pytest.mark.guarantees]


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    require_postgres()
    with live_server(extra_env={"TESTAPP_ALLOW_SIGKILL": "1"}) as running:
        yield running


def test_fifty_simultaneous_duplicates_run_once_and_replay(server: LiveServer) -> None:
    for round_number in range(5):
        note = f"single-storm-{round_number}-{uuid.uuid4().hex[:6]}"
        calls = [
            Call(
                f"{server.url}/api-view/single",
                {"amount": 1, "note": note, "sleep": 0.2},
                {"Idempotency-Key": note},
            )
            for _ in range(50)
        ]
        results = fire_together(calls)

        statuses = [result.status for result in results]
        assert server.database.count_charges(note) == 1, server.diagnostics()
        assert all(status in (201, 409) for status in statuses), statuses
        firsts = [r for r in results if r.status == 201 and not r.replayed]
        assert len(firsts) == 1
        assert {r.body for r in results if r.status == 201} == {firsts[0].body}


def test_a_process_killed_mid_view_leaves_nothing_behind(server: LiveServer) -> None:
    """The claim died with the transaction: no record, no charge, the retry runs."""
    for trial in range(10):
        key = f"single-crash-{trial}-{uuid.uuid4().hex[:6]}"
        with pytest.raises(requests.ConnectionError):
            requests.post(
                f"{server.url}/api-view/single",
                json={"amount": 1, "note": key, "die": True},
                headers={"Idempotency-Key": key},
                timeout=30,
            )
        assert server.database.count_records(key) == 0
        assert server.database.count_charges(key) == 0
        retry = None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # gunicorn restarts the killed worker
            try:
                retry = requests.post(
                    f"{server.url}/api-view/single",
                    json={"amount": 1, "note": key},
                    headers={"Idempotency-Key": key},
                    timeout=30,
                )
                break
            except requests.ConnectionError:
                time.sleep(0.2)
        assert retry is not None and retry.status_code == 201, server.diagnostics()
        assert "Idempotent-Replayed" not in retry.headers
        assert server.database.count_charges(key) == 1
