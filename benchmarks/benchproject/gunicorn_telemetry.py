"""gunicorn configuration for benchmarks/telemetry_cost.py (``-c python:<this module>``).

The SDK is installed after the fork, in each worker: its exporting threads
do not survive a fork, and each worker exports its own figures, as under
``opentelemetry-instrument``. ``child_exit`` is what prometheus_client's
multiprocess mode asks of every gunicorn configuration.
"""

from __future__ import annotations

import os
from typing import Any

from benchmarks.benchproject.telemetry import configuration, configure_sdk


def post_fork(server: Any, worker: Any) -> None:
    if configuration() == "sdk":
        configure_sdk()


def child_exit(server: Any, worker: Any) -> None:
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(worker.pid)  # type: ignore[no-untyped-call]
