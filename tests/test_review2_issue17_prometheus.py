"""Second review of issue 17: ``prometheus.metrics_view``, what it serves and how it says so."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from django.test import Client
from prometheus_client.exposition import choose_encoder

REPO = Path(__file__).resolve().parent.parent
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


def test_under_the_multiprocess_directory_the_page_is_what_the_docs_say(
    tmp_path: Path,
) -> None:
    """With ``PROMETHEUS_MULTIPROC_DIR`` the view serves the metrics of every
    process (the project's own counter too) and no custom collector, which
    ``prometheus_client`` cannot add up across processes: the view's docstring
    and docs/observability.md say so (the first review's wording promised
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
