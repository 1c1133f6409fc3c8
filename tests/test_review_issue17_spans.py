"""Review of issue 17: spans that say "error" where nothing went wrong."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connections
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from rest_framework.test import APIClient

from tests.telemetry import installed
from tests.utils import post

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    _, exporter = installed()
    exporter.clear()
    yield exporter
    exporter.clear()


def _two_at_once(url: str, body: dict[str, Any], key: str) -> list[Any]:
    barrier = threading.Barrier(2)
    results: list[Any] = []

    def send() -> None:
        try:
            barrier.wait()
            results.append(post(APIClient(), url, body, key))
        finally:
            connections.close_all()

    threads = [threading.Thread(target=send) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results
