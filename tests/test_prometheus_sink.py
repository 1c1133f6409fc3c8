"""The Prometheus sink, in processes of their own.

Each test runs a fresh Python process: ``prometheus_client``'s registry
and the package's sink are per process, made at the first request.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone
from prometheus_client.exposition import choose_encoder

from django_idempotency.models import IdempotencyRecord
from tests.factories import RecordFactory
from tests.utils import REPO, database_url, run_python

pytestmark = pytest.mark.django_db(transaction=True)


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


# ``prometheus.metrics_view``: what it serves and how it says so.

# What Prometheus 2.x sends, and the plain text format alone.
ACCEPT_HEADERS = ("", "text/plain;version=0.0.4;q=1,*/*;q=0.1")


@pytest.mark.parametrize("accept", ACCEPT_HEADERS, ids=["none", "text-0.0.4"])
def test_the_content_type_names_the_format_of_the_body(accept: str, settings: Any) -> None:
    """The view writes ``generate_latest()`` (the 0.0.4 text format) and labels it
    ``CONTENT_TYPE_LATEST``, which prometheus_client 0.26 made
    ``text/plain; version=1.0.0`` (the UTF-8 names format, whose escaping is
    then unstated). prometheus_client's own server answers the same request
    with ``version=0.0.4`` (``choose_encoder``).
    """
    settings.IDEMPOTENCY = {"METRICS": ("prometheus",)}
    headers = {"Accept": accept} if accept else {}

    response = Client().get("/metrics", headers=headers)

    assert response.status_code == 200
    _encoder, content_type = choose_encoder(accept)
    assert response["Content-Type"] == content_type


@pytest.mark.parametrize(
    "accept",
    [
        "application/openmetrics-text; version=abc",
        "text/plain; version=abc",
        "application/openmetrics-text; version=1.x, text/plain;version=0.0.4",
    ],
)
def test_a_format_version_prometheus_client_cannot_read_is_answered_in_the_text_format(
    accept: str, settings: Any
) -> None:
    """``choose_encoder`` compares the version's parts as numbers: "abc" raised TypeError, a 500."""
    settings.IDEMPOTENCY = {"METRICS": ("prometheus",)}

    response = Client().get("/metrics", headers={"Accept": accept})

    assert response.status_code == 200
    assert response["Content-Type"] == choose_encoder("")[1]
    assert b"# TYPE idempotency_requests_total counter" in response.content


def test_under_the_multiprocess_directory_the_page_is_what_the_docs_say(
    tmp_path: Path,
) -> None:
    """With ``PROMETHEUS_MULTIPROC_DIR`` the view serves the metrics of every
    process (the project's own counter too) and no custom collector, which
    ``prometheus_client`` cannot add up across processes: the view's docstring
    and docs/observability.md say so (an earlier wording promised
    "whatever else the project registered").
    """
    from django_idempotency.prometheus import metrics_view

    assert "only metrics are served" in (metrics_view.__doc__ or "")
    page = " ".join((REPO / "docs" / "observability.md").read_text(encoding="utf-8").split())
    assert "custom collectors, `Info`, `Enum`" in page
    code = textwrap.dedent(
        """
        import django
        django.setup()
        from prometheus_client import REGISTRY, Counter
        from prometheus_client.core import GaugeMetricFamily
        from django.test import Client

        class QueueDepth:
            def collect(self):
                yield GaugeMetricFamily("myproject_queue_depth", "Jobs waiting.", value=3)

        REGISTRY.register(QueueDepth())
        Counter("myproject_jobs", "Jobs done.").inc()  # a metric, in the directory's files
        page = Client().get("/metrics").content.decode()
        print("myproject_jobs_total 1.0" in page, "myproject_queue_depth 3.0" in page)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env={
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "tests.settings",
            "PROMETHEUS_MULTIPROC_DIR": str(tmp_path),
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        },
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )

    assert done.returncode == 0, done.stderr
    # The project's counter is served (the multiprocess files); its collector is not.
    assert done.stdout.split() == ["True", "False"], done.stdout


# The ``operation`` label across the processes that share one directory.

#: What each process runs: a worker of gunicorn's serving one request to a
#: route-named operation and five to operations a callable names per request
#: (the tenant header), none of which any other process names.
_WORKER = """
    import os, django
    django.setup()
    from django.test import Client, override_settings

    worker = os.environ["WORKER"]
    settings = {"METRICS": ("prometheus",), "METRICS_OPERATIONS": 3}
    with override_settings(
        ROOT_URLCONF="tests.testapp.dynamic_operation_urls", IDEMPOTENCY=settings
    ):
        client = Client()
        statuses = [client.post("/answers", headers={"Idempotency-Key": f"{worker}-r"})]
        for n in range(5):
            headers = {"Idempotency-Key": f"{worker}-{n}", "X-Tenant": f"{worker}-{n}"}
            statuses.append(client.post("/per-tenant/answers", headers=headers))
    print(*(response.status_code for response in statuses))
"""


def _operation_labels(directory: Path) -> set[str]:
    """The ``operation`` values of ``idempotency_requests_total`` a scrape adds up."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))  # type: ignore[no-untyped-call]
    return {
        sample.labels["operation"]
        for family in registry.collect()
        for sample in family.samples
        if sample.name == "idempotency_requests_total"
    }


def test_the_operation_label_is_bounded_across_every_process_of_the_directory(
    tmp_path: Path,
) -> None:
    """Four workers, each naming five operations of its own through a callable.

    ``METRICS_OPERATIONS`` bounded each process alone, by first use: every
    new worker (gunicorn's max_requests, a timeout, a deploy) let another
    set in, and dead workers' files kept them on the page. Only names the
    code declares (here the route's) are labels, in every process alike.
    """
    for worker in ("a", "b", "c", "d"):
        done = run_python(_WORKER, WORKER=worker, PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.split() == ["201"] * 6, done.stderr[-3000:]

    assert len(list(tmp_path.iterdir())) >= 4  # one file (or more) per process
    assert _operation_labels(tmp_path) == {"POST answers", "other"}


# Management commands run with the directory set, as cron and an operator run them.


def manage(*arguments: str, directory: Path | None) -> subprocess.CompletedProcess[str]:
    """``python -m django <arguments>`` with the Prometheus sink on, in a process of its own."""
    environment = {
        name: value for name, value in os.environ.items() if name != "PROMETHEUS_MULTIPROC_DIR"
    }
    if directory is not None:
        environment["PROMETHEUS_MULTIPROC_DIR"] = str(directory)
    return subprocess.run(
        [sys.executable, "-m", "django", *arguments],
        cwd=REPO,
        env={
            **environment,
            "DATABASE_URL": database_url(),
            "DJANGO_SETTINGS_MODULE": "tests.live.prometheus_settings",
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        },
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _stale_claim() -> None:
    RecordFactory.create(
        state=IdempotencyRecord.State.CLAIMED,
        operation="POST api-view/charges",
        lease_owner="dead-host:1:1",
        lease_expires_at=timezone.now() - timedelta(minutes=1),
        response_status=None,
        response_body=None,
    )


def _counted(directory: Path, name: str, **labels: str) -> float:
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))  # type: ignore[no-untyped-call]
    return sum(
        sample.value
        for family in registry.collect()
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


def test_commands_leave_no_file_per_run_in_the_directory_and_keep_their_counts(
    tmp_path: Path,
) -> None:
    """Cron's recover and purge each wrote a file of their own pid at every run
    (38 files after about 20 commands), read by every scrape for ever after.
    Their counts matter, so they are kept, in one file per command that each
    run goes on counting in; commands that count nothing write nothing.
    """
    for _ in range(3):
        _stale_claim()
        RecordFactory.create(expires_at=timezone.now() - timedelta(hours=1))
        for counting in ("idempotency_recover", "idempotency_purge"):
            done = manage(counting, directory=tmp_path)
            assert done.returncode == 0, done.stderr[-3000:]
    for command in (["shell", "-c", "pass"], ["idempotency_health"], ["check"]):
        done = manage(*command, directory=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]

    files = sorted(path.name for path in tmp_path.glob("*.db"))
    assert len(files) == 2, files  # one per command that counts
    assert _counted(tmp_path, "idempotency_recovery_total", outcome="released") == 3
    assert _counted(tmp_path, "idempotency_releases_total", reason="recovery") == 3
    assert _counted(tmp_path, "idempotency_purged_total", action="deleted") == 3


def test_two_runs_at_once_write_files_of_their_own_and_later_runs_reuse_them(
    tmp_path: Path,
) -> None:
    """A file's writes are not locked between processes: runs that overlap
    (a slow recover under the next minute's) each take a free slot."""
    code = textwrap.dedent(
        """
        import sys, django
        django.setup()
        from django_idempotency._observability.prometheus import write_to_files_named
        from prometheus_client import Counter
        write_to_files_named("idempotency_recover")
        Counter("runs", "Runs.").inc()
        print("counted", flush=True)
        sys.stdin.readline()  # held until the test lets it end
        """
    )
    environment = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "PROMETHEUS_MULTIPROC_DIR": str(tmp_path),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }

    def start() -> subprocess.Popen[str]:
        process = subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=REPO,
            env=environment,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert process.stdout is not None and process.stdout.readline() == "counted\n"
        return process

    def end(*processes: subprocess.Popen[str]) -> None:
        for process in processes:
            process.communicate("\n", timeout=60)
            assert process.returncode == 0

    end(start(), start())  # overlapping
    end(start())  # alone: the first slot again
    end(start(), start())

    assert sorted(path.name for path in tmp_path.glob("*.db")) == [
        "counter_idempotency-recover-0.db",
        "counter_idempotency-recover-1.db",
    ]
    assert _counted(tmp_path, "runs_total") == 5
