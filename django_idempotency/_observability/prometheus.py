"""The Prometheus sink of ``metrics``: one ``prometheus_client`` metric per instrument.

Why ``prometheus_client`` and its multiprocess mode, rather than the
OpenTelemetry Prometheus exporter: under gunicorn every worker process
keeps its own counts, and a scrape reaches one worker at random. The
OpenTelemetry exporter serves only the process it runs in (it has no
multiprocess mode); ``prometheus_client`` writes each process's values to
files in ``PROMETHEUS_MULTIPROC_DIR`` and sums them at the scrape, which is
also how django-prometheus runs under gunicorn, so its ``/metrics`` shows
these metrics too. (OTLP to an OpenTelemetry collector is the other way
that works: the ``"opentelemetry"`` sink with the SDK's OTLP exporter.)

Set ``PROMETHEUS_MULTIPROC_DIR`` to an empty directory before the workers
start, and in gunicorn's configuration::


    def child_exit(server, worker):
        multiprocess.mark_process_dead(worker.pid)

"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Mapping
from typing import Any

from django.core.exceptions import ImproperlyConfigured

try:
    import prometheus_client
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ImproperlyConfigured(
        "prometheus_client is not installed; the Prometheus sink (IDEMPOTENCY['METRICS'] "
        "naming 'prometheus') and django_idempotency.prometheus.metrics_view need it: "
        'pip install "django-idempotency[prometheus]"'
    ) from exc

from django_idempotency.metrics import DURATION_BUCKETS, INSTRUMENTS, Instrument


class PrometheusSink:
    """``prometheus_client`` metrics in its default registry (one set per process)."""

    #: prometheus_client keeps every count, scraped or not.
    receiving = True

    def __init__(self) -> None:
        self.metrics: dict[str, Any] = {}
        for instrument in INSTRUMENTS:
            self.metrics[instrument.name] = _made(instrument)

    def add(self, instrument: Instrument, amount: float, labels: Mapping[str, str]) -> None:
        self._child(instrument, labels).inc(amount)

    def record(self, instrument: Instrument, value: float, labels: Mapping[str, str]) -> None:
        self._child(instrument, labels).observe(value)

    def set(self, instrument: Instrument, value: float, labels: Mapping[str, str]) -> None:
        self._child(instrument, labels).set(value)

    def _child(self, instrument: Instrument, labels: Mapping[str, str]) -> Any:
        # Every label is declared up front; one a call leaves out (the tenant,
        # unless METRICS_TENANT) is empty, which Prometheus reads as absent.
        return self.metrics[instrument.name].labels(
            *(labels.get(name, "") for name in instrument.labels)
        )

    def __repr__(self) -> str:
        return "PrometheusSink()"


def _made(instrument: Instrument) -> Any:
    name = instrument.prometheus_name
    text = instrument.description
    labels = instrument.labels
    if instrument.kind == "counter":
        return prometheus_client.Counter(name, text, labels)
    if instrument.kind == "histogram":
        return prometheus_client.Histogram(name, text, labels, buckets=DURATION_BUCKETS)
    # The gauges are set by one process at a time (the beat-driven task):
    # the value it set last is the answer, whichever process serves the scrape.
    return prometheus_client.Gauge(name, text, labels, multiprocess_mode="mostrecent")


_sink: PrometheusSink | None = None
_making = threading.Lock()


def prometheus_sink() -> PrometheusSink:
    """The process's one sink: ``prometheus_client`` allows each name once per registry."""
    global _sink
    with _making:  # two threads registering the same names at once would collide
        if _sink is None:
            _sink = PrometheusSink()
        return _sink


#: The lock file of the files this process writes to, held open until it exits.
_slot: int | None = None


def write_to_files_named(name: str) -> None:
    """Write this process's values to files named for ``name``, which each run reuses.

    ``prometheus_client`` names a process's files by its pid, and a dead
    process's counts are summed at every scrape for ever after: cron running
    ``idempotency_recover`` every few minutes left a file per run (38 files
    after about 20 commands), each read by every scrape. Named for the
    command instead, the next run opens the same file and counts on from its
    values, so the counts are kept and the files do not pile up.

    Two runs at once must not write one file (its writes are not locked
    between processes): each takes the first free slot, ``<name>-0``,
    ``<name>-1``..., by a lock on ``<name>-<n>.lock`` held until it exits.
    A process forked from this one goes back to its pid's files. Call it
    before anything is counted: values made before keep the pid's files.
    """
    global _slot
    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not directory or _slot is not None:
        return
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not on POSIX: the pid's files, as before
        return
    from prometheus_client import values

    # The file name's parts are split at "_": the identity holds none.
    stem = name.replace("_", "-")
    for number in itertools.count():
        lock = os.open(os.path.join(directory, f"{stem}-{number}.lock"), os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock)  # another run holds this one
            continue
        _slot = lock
        identity = f"{stem}-{number}"
        break
    owner = os.getpid()
    values.ValueClass = values.MultiProcessValue(  # type: ignore[no-untyped-call]
        lambda: identity if os.getpid() == owner else os.getpid()
    )
