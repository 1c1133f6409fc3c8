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

import importlib
import os
from types import ModuleType
from typing import Any

#: The variables the API reads a provider's entry point name from.
_TRACER_VARIABLE = "OTEL_PYTHON_TRACER_PROVIDER"
_METER_VARIABLE = "OTEL_PYTHON_METER_PROVIDER"


_UNKNOWN: Any = object()
#: The API's modules once looked for (None: not installed).
_trace: Any = _UNKNOWN
_metrics: Any = _UNKNOWN
#: Whether the environment names a provider, read once (see above).
_environment_names: dict[str, bool] = {}


def trace_api() -> ModuleType | None:
    """``opentelemetry.trace``, or None when the API is not installed."""
    global _trace
    if _trace is _UNKNOWN:
        _trace = _imported("opentelemetry.trace")
    return _trace  # type: ignore[no-any-return]


def _metrics_api() -> ModuleType | None:
    global _metrics
    if _metrics is _UNKNOWN:
        _metrics = _imported("opentelemetry.metrics._internal")
    return _metrics  # type: ignore[no-any-return]


def _imported(module: str) -> ModuleType | None:
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


def _named_by_environment(variable: str) -> bool:
    named = _environment_names.get(variable)
    if named is None:
        named = _environment_names[variable] = variable in os.environ
    return named


def tracer_provider_set() -> bool:
    """Whether spans started through the API are recorded by a provider (an SDK's)."""
    api = _trace if _trace is not _UNKNOWN else trace_api()
    if api is None:
        return False
    # The API's global, None until a provider is set (set once, never unset).
    # Read before calling its getter, which would look the environment up;
    # an API without that global is asked through its getter, as documented.
    provider = getattr(api, "_TRACER_PROVIDER", _UNKNOWN)
    if provider is None:
        if not _named_by_environment(_TRACER_VARIABLE):
            return False
        provider = api.get_tracer_provider()
    elif provider is _UNKNOWN:
        provider = api.get_tracer_provider()
    return not isinstance(provider, api.ProxyTracerProvider)


def meter_provider_set() -> bool:
    """Whether measurements made through the API reach a provider (an SDK's)."""
    api = _metrics if _metrics is not _UNKNOWN else _metrics_api()
    if api is None:
        return False
    provider = getattr(api, "_METER_PROVIDER", _UNKNOWN)  # as the tracer provider's
    if provider is None:
        if not _named_by_environment(_METER_VARIABLE):
            return False
        provider = api.get_meter_provider()
    elif provider is _UNKNOWN:
        provider = api.get_meter_provider()
    return not isinstance(provider, getattr(api, "_ProxyMeterProvider", ()))
