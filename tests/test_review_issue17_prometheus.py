"""Review of issue 17: the Prometheus sink, in processes of their own.

Each test runs a fresh Python process: ``prometheus_client``'s registry
and the package's sink are per process, made at the first request.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.test_health_command import database_url

pytestmark = pytest.mark.django_db(transaction=True)

REPO = Path(__file__).resolve().parent.parent


def run_python(code: str, **environment: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO,
        env={
            **os.environ,
            "DATABASE_URL": database_url(),
            "DJANGO_SETTINGS_MODULE": "tests.settings",
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            **environment,
        },
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_threads_making_the_sink_at_once_do_not_fail() -> None:
    """Eight threads of a fresh worker reach the "prometheus" sink at once.

    ``metrics._sinks_for`` and ``prometheus.prometheus_sink`` are
    ``functools.cache``d, which does not stop two threads from building the
    sink together: the second registers the same names in
    ``prometheus_client``'s registry, which raises ``DuplicateTimeseries``.
    ``observe_request()`` calls ``sinks()`` outside any guard, before the
    claim, so in a threaded worker (gunicorn's gthread, a threaded
    runserver) the first concurrent protected requests are 500s. A short
    switch interval makes the race show in every run instead of now and
    then; through the test client the requests seldom meet at that point.
    """
    result = run_python(
        """
        import json, sys, threading
        import django
        django.setup()
        from django.conf import settings
        from django_idempotency._observability import recording as metrics
        settings.IDEMPOTENCY = {"METRICS": ("prometheus",)}
        sys.setswitchinterval(1e-6)
        barrier = threading.Barrier(8)
        errors = []
        def first_request():
            barrier.wait()
            try:
                metrics.sinks()
            except Exception as exc:
                errors.append(repr(exc))
        threads = [threading.Thread(target=first_request) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        print(json.dumps(errors))
        """
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == []


def test_a_sink_that_cannot_be_made_never_fails_the_request() -> None:
    """The project's own glue already counts ``idempotency_requests_total``.

    The docs promise that a failing sink never fails a request, and
    ``_send`` keeps that for each value; but building the sink happens in
    ``observe_request()``, unguarded: ``prometheus_client`` refuses a name
    registered twice, and every protected request of the process is a 500
    (the cache keeps no exception, so each one tries again and fails).
    """
    result = run_python(
        """
        import django
        django.setup()
        import prometheus_client
        from django.conf import settings
        from rest_framework.test import APIClient
        # A project's counter, from before the package had metrics.
        prometheus_client.Counter("idempotency_requests", "Ours.", ["outcome"])
        settings.IDEMPOTENCY = {"METRICS": ("prometheus",)}
        client = APIClient()
        client.raise_request_exception = False
        for key in ("r17-a", "r17-b"):
            response = client.post(
                "/api-view/charges", {"amount": 1}, format="json", HTTP_IDEMPOTENCY_KEY=key
            )
            print(response.status_code)
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["201", "201"], result.stderr[-3000:]
