"""Helpers for your own test suite.

``assert_protected`` checks a view's contract with Django's test client;
``fire_duplicates`` sends real concurrent duplicates at a live server (for
example pytest-django's ``live_server``); ``simulate_crash_after_begin_external``,
``simulate_crash_after_set_provider_operation`` and ``expire_leases`` let
you test your reconcilers.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db import connections

from django_idempotency import _store as store
from django_idempotency._protection.crash import SimulatedCrash, armed
from django_idempotency._store.routing import record_databases
from django_idempotency.conf import idempotency_settings
from django_idempotency.exceptions import REFUSAL_CODES

__all__ = [
    "REFUSAL_CODES",
    "Duplicates",
    "SimulatedCrash",
    "assert_protected",
    "expire_leases",
    "fire_duplicates",
    "simulate_crash_after_begin_external",
    "simulate_crash_after_set_provider_operation",
]


@contextmanager
def simulate_crash_after_begin_external(*, step: str | None = None) -> Iterator[None]:
    """Make a ``begin_external()`` on this thread "kill the process".

    In an async test, the requests awaited in the block are armed too
    (``await client.post(...)`` with Django's ``AsyncClient``): their claim
    and writes run in a thread of asgiref's, in the test's context.

    The intent commits (IN_PROGRESS and the provider key, or the step's row),
    then ``SimulatedCrash`` is raised: the view's transaction rolls back and
    the record is left behind exactly as a worker dying mid-call leaves it.
    Catch ``SimulatedCrash`` around the request, then ``expire_leases()``
    and run ``recover_stale_records()`` to exercise your reconciler.

    Needs PostgreSQL or MySQL/MariaDB: on SQLite the intent is written
    inside the view's transaction (one writer at a time), so a crash leaves
    a CLAIMED record that recovery releases without asking the reconciler.

    Args:
        step: Crash at ``begin_external(step=step)``: the steps begun before
            it run (and call their provider) as usual. ``None``: at the
            first ``begin_external()``, whatever its step.

    Raises:
        ImproperlyConfigured: A database holding records is SQLite.
    """
    _refuse_sqlite("simulate_crash_after_begin_external()")
    with armed("begin_external", step):
        yield


@contextmanager
def simulate_crash_after_set_provider_operation(*, step: str | None = None) -> Iterator[None]:
    """Make a ``set_provider_operation()`` on this thread "kill the process".

    The crash after a call: the provider did the work and answered, the
    view committed the provider's id, then the process died before the
    response was stored. The record is left IN_PROGRESS with that id (the
    record's, or the step's), as after ``simulate_crash_after_begin_external``;
    your reconciler finds it there.

    To die between the provider's answer and ``set_provider_operation()``
    (the provider charged, its id never recorded), have your provider
    client's test double raise ``SimulatedCrash`` after doing the work.

    Needs PostgreSQL or MySQL/MariaDB, as ``simulate_crash_after_begin_external``.

    Args:
        step: Crash at ``set_provider_operation(..., step=step)``: the steps
            before it run to their end. ``None``: at the first
            ``set_provider_operation()``, whatever its step.

    Raises:
        ImproperlyConfigured: A database holding records is SQLite.
    """
    _refuse_sqlite("simulate_crash_after_set_provider_operation()")
    with armed("set_provider_operation", step):
        yield


def _refuse_sqlite(helper: str) -> None:
    if any(connections[alias].vendor == "sqlite" for alias in record_databases()):
        raise ImproperlyConfigured(
            f"{helper} needs PostgreSQL or MySQL/MariaDB: on SQLite a crash leaves a "
            "CLAIMED record and no reconciler is asked."
        )


def expire_leases() -> int:
    """End every unresolved record's lease now, as if its owner were long gone.

    In every database that holds records (``IDEMPOTENCY["DATABASE"]``, or
    with ``None`` every alias the routers let the records migrate to).

    Returns:
        How many records' leases it ended.
    """
    return sum(store.expire_leases(using=alias) for alias in record_databases())


def assert_protected(
    client: Any,
    url: str,
    data: Mapping[str, Any],
    *,
    changed: Mapping[str, Any] | None = None,
    required: bool | None = None,
) -> None:
    """Assert that POSTing ``data`` to ``url`` is protected as docs/http.md says.

    Checks: a missing key is refused with 400 (when keys are required); a
    retry with the same key replays the first answer byte for byte, with
    ``Idempotent-Replayed: true``; the same key with changed input is
    refused with 422.

    Args:
        client: A Django (or DRF) test client, authenticated as needed.
        url: The protected endpoint.
        data: The JSON body to POST.
        changed: Input that must count as a different request. ``None``:
            ``data`` plus a field; pass it when the view fingerprints
            selected fields only.
        required: Whether the view refuses a request without a key; pass it
            when the view's ``required=`` differs from
            ``IDEMPOTENCY["REQUIRED"]``.

    Raises:
        AssertionError: The view does not behave as protected.
    """
    header = "HTTP_" + idempotency_settings.HEADER.upper().replace("-", "_")
    key = f"assert-protected-{uuid.uuid4()}"
    body = json.dumps(dict(data))

    def send(payload: str, **extra: str) -> Any:
        return client.post(url, payload, content_type="application/json", **extra)

    if required if required is not None else idempotency_settings.REQUIRED:
        missing = send(body)
        assert missing.status_code == 400, f"no key: expected 400, got {missing.status_code}"
    first = send(body, **{header: key})
    retry = send(body, **{header: key})
    assert first.status_code < 500, f"first request failed with {first.status_code}"
    assert retry.get("Idempotent-Replayed") == "true", "the retry was not a replay"
    assert (retry.status_code, retry.content) == (first.status_code, first.content), (
        "the replay differs from the original answer"
    )
    other = dict(changed) if changed is not None else {**data, "_assert_protected": 1}
    mismatch = send(json.dumps(other), **{header: key})
    assert mismatch.status_code == 422, f"changed input: expected 422, got {mismatch.status_code}"


@dataclass
class Duplicates:
    """What ``fire_duplicates`` got back, one entry per request.

    Attributes:
        statuses: The HTTP statuses.
        bodies: The response bodies.
        replayed: Whether each answer carried ``Idempotent-Replayed: true``.
    """

    statuses: list[int] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)
    replayed: list[bool] = field(default_factory=list)

    @property
    def refused(self) -> int:
        """Answers refused by the idempotency layer (409 in progress, say)."""
        return sum(_refusal_code(body) in REFUSAL_CODES for body in self.bodies)

    @property
    def executed(self) -> int:
        """Answers that ran the view to an outcome: not replays, refusals or 5xx.

        Expect 1. (A 5xx released its claim and rolled its writes back.)
        """
        failed = sum(status >= 500 for status in self.statuses)
        return len(self.statuses) - sum(self.replayed) - self.refused - failed


def _refusal_code(body: bytes) -> object:
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    return parsed.get("code") if isinstance(parsed, dict) else None


def fire_duplicates(
    url: str,
    *,
    count: int = 20,
    body: Mapping[str, Any] | None = None,
    key: str | None = None,
    headers: Mapping[str, str] | None = None,
    timeout: float = 30,
) -> Duplicates:
    """POST ``count`` identical requests at ``url`` at the same moment.

    Real HTTP over real connections (one thread each, released together),
    so run it against a live server backed by a real database (pytest-django's
    ``live_server``, say).

    Args:
        url: The protected endpoint's full URL.
        count: How many duplicates to send.
        body: The JSON body, the same for each; ``None``: ``{}``.
        key: The ``Idempotency-Key`` they share; ``None``: a fresh one.
        headers: Extra request headers (authentication, say).
        timeout: Seconds each request may take.

    Returns:
        The answers; ``executed`` should be 1.
    """
    key = key or f"duplicates-{uuid.uuid4()}"
    payload = json.dumps(dict(body or {})).encode()
    request_headers = {
        "Content-Type": "application/json",
        idempotency_settings.HEADER: key,
        **(headers or {}),
    }
    barrier = threading.Barrier(count)
    results: list[tuple[int, bytes, bool]] = []
    lock = threading.Lock()

    def send() -> None:
        request = urllib.request.Request(url, payload, request_headers, method="POST")
        barrier.wait()
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                outcome = (response.status, response.read(), response.headers)
        except urllib.error.HTTPError as error:
            outcome = (error.code, error.read(), error.headers)
        replayed = outcome[2].get("Idempotent-Replayed") == "true"
        with lock:
            results.append((outcome[0], outcome[1], replayed))

    threads = [threading.Thread(target=send) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    duplicates = Duplicates()
    for status, content, replayed in results:
        duplicates.statuses.append(status)
        duplicates.bodies.append(content)
        duplicates.replayed.append(replayed)
    return duplicates
