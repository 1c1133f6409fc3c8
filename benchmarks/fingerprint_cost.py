"""What fingerprinting a large body costs: peak memory and CPU time.

    python -m benchmarks.fingerprint_cost

Two bodies of about 2.6 MB (just under MAX_FINGERPRINTED_BODY, 2.5 MiB):
floats whose positional spelling is longest (``1e308``, ``5e-324``), and an
ordinary JSON body (a list of orders). Each is parsed as DRF's JSON parser
would (``json.loads``), then fingerprinted; the figures are the fingerprint's
alone: peak memory traced by ``tracemalloc`` (a separate run, since tracing
slows Python down) and CPU time (``time.process_time``, best of three).
To measure another version, put its checkout first on ``PYTHONPATH``.
"""

from __future__ import annotations

import json
import time
import tracemalloc
from collections.abc import Callable

import django
from django.conf import settings

settings.configure()
django.setup()

from django_idempotency import fingerprint as module  # noqa: E402

TARGET = 2_600_000


def hostile_body() -> bytes:
    numbers = ["1e308", "5e-324"] * (TARGET // 13)
    return ("[" + ",".join(numbers) + "]").encode()


def ordinary_body() -> bytes:
    orders = []
    size = 2
    while size < TARGET:
        order = {
            "order_id": f"ORD-{len(orders):06d}",
            "amount": 4200 + len(orders),
            "currency": "EUR",
            "price": 12.5,
            "customer": {"email": "a@example.com", "name": "Zoë Example"},
            "tags": ["gift", "express"],
        }
        orders.append(order)
        size += len(json.dumps(order)) + 2
    return json.dumps(orders).encode()


def measure(name: str, body: bytes, fingerprint: Callable[[object], str]) -> None:
    value = json.loads(body)
    tracemalloc.start()
    fingerprint(value)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    seconds = []
    for _ in range(3):
        start = time.process_time()
        fingerprint(value)
        seconds.append(time.process_time() - start)
    parse_start = time.process_time()
    json.loads(body)
    parse = time.process_time() - parse_start
    print(
        f"{name:9} body {len(body) / 1e6:.2f} MB  fingerprint: peak {peak / 1e6:7.2f} MB, "
        f"CPU {min(seconds):.2f} s  (json.loads alone: {parse:.2f} s)"
    )


if __name__ == "__main__":
    print(f"django_idempotency.fingerprint from {module.__file__}")
    measure("hostile", hostile_body(), module.fingerprint)
    measure("ordinary", ordinary_body(), module.fingerprint)
