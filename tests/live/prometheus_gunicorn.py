"""gunicorn settings for the Prometheus live test: ``-c python:tests.live.prometheus_gunicorn``.

The configuration prometheus_client's multiprocess mode asks for: when a
worker exits, its live gauges' files are marked dead. Its counters and
histograms stay in ``PROMETHEUS_MULTIPROC_DIR`` and keep counting in the
totals: a killed worker's replays are not lost from the sum.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import multiprocess


def child_exit(server: Any, worker: Any) -> None:
    # prometheus_client ships no annotations for its multiprocess module.
    multiprocess.mark_process_dead(worker.pid)  # type: ignore[no-untyped-call]
