"""System checks of the metrics settings: the sinks (E037, W022) and the label bound (E038).

``METRICS_TENANT`` and ``TRACING`` are booleans, checked from their
declarations by ``django_idempotency.checks``, which registers these.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator, Mapping
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Warning

from django_idempotency._checks import Validator, error, is_count
from django_idempotency.conf import DEFAULTS

#: The sinks IDEMPOTENCY["METRICS"] may name, and the module each needs.
_METRICS_SINKS = {"opentelemetry": "opentelemetry", "prometheus": "prometheus_client"}


def _check_metrics(value: Any) -> Iterator[CheckMessage]:
    sinks = (value,) if isinstance(value, str) else value
    if not isinstance(sinks, (list, tuple)) or not all(isinstance(s, str) for s in sinks):
        yield error(
            37,
            f"IDEMPOTENCY['METRICS'] = {value!r} is not a tuple of sink names.",
            'Set it to ("opentelemetry",), ("prometheus",), both, or () for no metrics.',
        )
        return
    for sink in sinks:
        if sink not in _METRICS_SINKS:
            yield error(
                37,
                f"IDEMPOTENCY['METRICS'] names {sink!r}, which is not a metrics sink.",
                f"The sinks are {', '.join(map(repr, _METRICS_SINKS))}.",
            )
        elif sink == "prometheus" and importlib.util.find_spec("prometheus_client") is None:
            # The OpenTelemetry API missing is no error: the default sink is
            # then a no-op, as it is without an SDK.
            yield error(
                37,
                "IDEMPOTENCY['METRICS'] names 'prometheus', but prometheus_client is not "
                "installed.",
                'pip install "django-idempotency[prometheus]"',
            )


def _check_metrics_operations(value: Any) -> Iterator[CheckMessage]:
    if not is_count(value, least=1):
        yield error(
            38,
            f"IDEMPOTENCY['METRICS_OPERATIONS'] = {value!r} is not a positive integer.",
            "Give the number of distinct operation names to label metrics with (100 by "
            "default); later ones are counted as 'other'.",
        )


VALIDATORS: Mapping[str, Validator] = {
    "METRICS": _check_metrics,
    "METRICS_OPERATIONS": _check_metrics_operations,
}


def check_prometheus_directory(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """W022: the Prometheus sink without (or with a missing) multiprocess directory.

    A deployment check (``manage.py check --deploy``): a single process
    (runserver) needs no directory, and a command (migrate, cron's recover)
    serves no scrape; printed by each of them, it was noise where it did not
    apply, and taught operators to skip it where it does.
    """
    user_settings = getattr(settings, "IDEMPOTENCY", {})
    if not isinstance(user_settings, Mapping):
        return []  # E001 says so
    sinks = user_settings.get("METRICS", DEFAULTS["METRICS"])
    if isinstance(sinks, str):
        sinks = (sinks,)
    if not isinstance(sinks, (list, tuple)) or "prometheus" not in sinks:
        return []  # no Prometheus sink, or E037 says what is wrong with the value
    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if directory and os.path.isdir(directory):
        return []
    problem = (
        "PROMETHEUS_MULTIPROC_DIR is not set"
        if not directory
        else f"PROMETHEUS_MULTIPROC_DIR names {directory!r}, which is not a directory"
    )
    return [
        Warning(
            f"IDEMPOTENCY['METRICS'] names 'prometheus', but {problem}: each process "
            "serves only its own counts, and a scrape reaches one gunicorn worker of several.",
            hint="Under gunicorn (or uWSGI) with several workers, set PROMETHEUS_MULTIPROC_DIR "
            "to a directory shared by every process before they start (https://django-"
            "idempotency.readthedocs.io/en/latest/observability/#prometheus-under-gunicorn). "
            "A deployment of one process (one worker) needs none: silence this warning "
            "there.",
            id="django_idempotency.W022",
        )
    ]
