"""Repository-wide pytest setup: the payment provider simulator for the demo app.

The demo project's ``POST /v1/payments`` charges through the payment
provider simulator (``testproject/provider``), a separate HTTP process. The
in-process tests of that API (``tests/test_testproject.py``) need one: a
simulator is started once per test session, on a free port with a fresh
ledger file, and ``PAYMENTS_PROVIDER_URL`` points at it (the test settings
do not set it, so the client reads the environment). It starts lazily, the
first time a test asks for the ``payments_provider`` fixture or uses the
``payments`` app's create view through the autouse fixture below, so runs
that never touch the payments API never start it.

The live tests start their own simulators (``tests/live/processes.py``).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

#: The rule by which the server passes leave database-independent tests to
#: the SQLite pass (``--database-tests-only``).
pytest_plugins = ["tests.selection"]

REPO_ROOT = Path(__file__).resolve().parent
PROVIDER_SCRIPT = REPO_ROOT / "testproject" / "provider" / "server.py"
#: Test modules whose tests POST to the demo's payments API in-process.
USES_PROVIDER = ("tests/test_testproject.py",)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="session")
def payments_provider() -> Iterator[str]:
    """A running provider simulator for the session; yields its base URL."""
    import requests

    port = _free_port()
    workdir = Path(tempfile.mkdtemp(prefix="provider-"))
    log = (workdir / "provider.log").open("wb")
    process = subprocess.Popen(
        [
            sys.executable,
            str(PROVIDER_SCRIPT),
            "--port",
            str(port),
            "--ledger",
            str(workdir / "ledger.sqlite3"),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while True:
        if process.poll() is not None:
            raise RuntimeError(
                f"the provider simulator exited with {process.returncode}: "
                + (workdir / "provider.log").read_text(errors="replace")
            )
        with contextlib.suppress(requests.RequestException):
            if requests.get(f"{url}/health", timeout=1).status_code == 200:
                break
        if time.monotonic() > deadline:
            process.kill()
            raise RuntimeError("the provider simulator did not start within 20 s")
        time.sleep(0.05)
    previous = os.environ.get("PAYMENTS_PROVIDER_URL")
    os.environ["PAYMENTS_PROVIDER_URL"] = url
    try:
        yield url
    finally:
        if previous is None:
            os.environ.pop("PAYMENTS_PROVIDER_URL", None)
        else:
            os.environ["PAYMENTS_PROVIDER_URL"] = previous
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
        for path in sorted(workdir.iterdir()):
            path.unlink()
        workdir.rmdir()


@pytest.fixture(autouse=True)
def _provider_for_the_payments_api(request: pytest.FixtureRequest) -> None:
    if request.node.nodeid.startswith(USES_PROVIDER):
        request.getfixturevalue("payments_provider")
