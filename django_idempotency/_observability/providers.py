"""Whether an OpenTelemetry SDK is there to receive what the API is handed.

Until a project sets a tracer provider (or a meter provider), the API's
proxies record nothing: spans started on them are dropped, and so are the
measurements made on instruments of the proxy meter (they start reaching
the SDK once one is set). Making either on every request is work for an
observer nobody registered, so the package asks here first and does none.

The API's own getters look the environment up on each call until a
provider is set (``OTEL_PYTHON_TRACER_PROVIDER`` may name one to load);
most of a request's price for asking was that lookup. So the provider set
in code is read first, and the environment once per process: the
variables that name a provider are read when the process starts, as
``opentelemetry-instrument`` sets them. A provider set later, at any time,
is seen at the next request: the globals are read each time.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType

#: The variables the API reads a provider's entry point name from.
_TRACER_VARIABLE = "OTEL_PYTHON_TRACER_PROVIDER"
_METER_VARIABLE = "OTEL_PYTHON_METER_PROVIDER"


@functools.cache
def trace_api() -> ModuleType | None:
    """``opentelemetry.trace``, or None when the API is not installed."""
    try:
        from opentelemetry import trace
    except ImportError:
        return None
    return trace


@functools.cache
def _metrics_api() -> ModuleType | None:
    try:
        from opentelemetry.metrics import _internal as metrics
    except ImportError:
        return None
    return metrics


@functools.cache
def _named_by_environment(variable: str) -> bool:
    return variable in os.environ


def tracer_provider_set() -> bool:
    """Whether spans started through the API are recorded by a provider (an SDK's)."""
    api = trace_api()
    if api is None:
        return False
    # The API's global, None until a provider is set (set once, never unset).
    # Read before calling its getter, which would look the environment up;
    # an API without that global is asked through its getter, as documented.
    provider = getattr(api, "_TRACER_PROVIDER", None)
    if provider is None:
        if hasattr(api, "_TRACER_PROVIDER") and not _named_by_environment(_TRACER_VARIABLE):
            return False
        provider = api.get_tracer_provider()
    return not isinstance(provider, api.ProxyTracerProvider)


def meter_provider_set() -> bool:
    """Whether measurements made through the API reach a provider (an SDK's)."""
    api = _metrics_api()
    if api is None:
        return False
    provider = getattr(api, "_METER_PROVIDER", None)  # as the tracer provider's
    if provider is None:
        if hasattr(api, "_METER_PROVIDER") and not _named_by_environment(_METER_VARIABLE):
            return False
        provider = api.get_meter_provider()
    return not isinstance(provider, getattr(api, "_ProxyMeterProvider", ()))
