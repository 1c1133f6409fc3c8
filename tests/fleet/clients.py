"""Clients of the payments API that retry as a well-behaved client should.

``pay()`` sends one payment under one Idempotency-Key until it has an
answer that is not "try again": on a 409 ``idempotency_request_in_progress``
(the first copy still runs, or its outcome is being settled) it waits
``Retry-After`` plus jitter, on a
connection error, a timeout or a 5xx it waits an exponential backoff with
full jitter, and always retries with the same key and the same body. Once
it has its answer it asks once more, as a client that lost the answer
would: that replay must carry the same bytes.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any

import requests

RETRYABLE_CODES = {"idempotency_request_in_progress"}
BASE_BACKOFF = 0.2
MAX_BACKOFF = 3.0
REQUEST_TIMEOUT = 20.0


@dataclass
class Attempt:
    status: int | None
    code: str = ""
    retry_after: str | None = None
    replayed: bool = False
    error: str = ""
    elapsed: float = 0.0


@dataclass
class Payment:
    key: str
    order_id: str
    attempts: list[Attempt] = field(default_factory=list)
    replay_attempts: list[Attempt] = field(default_factory=list)
    #: The first final answer (status, body) and the replay asked for after it.
    answer: tuple[int, bytes] | None = None
    replay: tuple[int, bytes, bool] | None = None
    duration: float = 0.0


def headers(token: str, key: str, slow_delay: float | None = None) -> dict[str, str]:
    sent = {"Authorization": f"Token {token}", "Idempotency-Key": key}
    if slow_delay is not None:
        sent |= {"X-Simulate": "slow", "X-Simulate-Delay": str(slow_delay)}
    return sent


def body(order_id: str) -> dict[str, Any]:
    return {"order_id": order_id, "amount": 1250, "currency": "EUR"}


def code_of(response: requests.Response) -> str:
    try:
        return str(response.json().get("code", ""))
    except ValueError:
        return ""


def until_answered(
    session: requests.Session,
    url: str,
    token: str,
    key: str,
    order_id: str,
    *,
    slow_delay: float | None,
    deadline: float,
    attempts: list[Attempt],
) -> requests.Response | None:
    """Send until the answer is not "try again"; that answer, or None at the deadline."""
    backoff = BASE_BACKOFF
    while time.monotonic() < deadline:
        begun = time.monotonic()
        try:
            response = session.post(
                url + "/v1/payments",
                json=body(order_id),
                headers=headers(token, key, slow_delay),
                timeout=REQUEST_TIMEOUT,
            )
        except requests.RequestException as exc:
            attempts.append(
                Attempt(None, error=type(exc).__name__, elapsed=time.monotonic() - begun)
            )
            time.sleep(random.uniform(0, backoff))
            backoff = min(backoff * 2, MAX_BACKOFF)
            continue
        attempt = Attempt(
            response.status_code,
            code_of(response),
            response.headers.get("Retry-After"),
            response.headers.get("Idempotent-Replayed") == "true",
            elapsed=time.monotonic() - begun,
        )
        attempts.append(attempt)
        if response.status_code == 409 and attempt.code in RETRYABLE_CODES:
            time.sleep(float(attempt.retry_after or 1) + random.uniform(0, backoff))
        elif response.status_code >= 500:
            time.sleep(random.uniform(0, backoff))
        else:
            return response
        backoff = min(backoff * 2, MAX_BACKOFF)
    return None


def pay(
    url: str,
    token: str,
    key: str,
    order_id: str,
    *,
    slow_delay: float | None,
    deadline: float,
) -> Payment:
    payment = Payment(key, order_id)
    started = time.monotonic()
    with requests.Session() as session:
        answer = until_answered(
            session, url, token, key, order_id,
            slow_delay=slow_delay, deadline=deadline, attempts=payment.attempts,
        )  # fmt: skip
        payment.duration = time.monotonic() - started
        if answer is None:
            return payment
        payment.answer = (answer.status_code, answer.content)
        # A client that lost the answer asks again (same policy, no slow header).
        again = until_answered(
            session, url, token, key, order_id,
            slow_delay=None, deadline=deadline + 30, attempts=payment.replay_attempts,
        )  # fmt: skip
        if again is not None:
            payment.replay = (
                again.status_code,
                again.content,
                again.headers.get("Idempotent-Replayed") == "true",
            )
    return payment
