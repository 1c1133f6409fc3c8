"""The client recipe of docs/clients.md with requests instead of httpx.

Needs requests and stamina: pip install requests "stamina>=26.2"
"""

from __future__ import annotations

import email.utils
import time
import uuid
from dataclasses import dataclass
from typing import Any

import requests
import stamina
from stamina.exceptions import TryAgain

#: The request may or may not have reached the server: the key makes resending it safe.
CONNECTION_ERRORS = (
    requests.ConnectionError,
    requests.Timeout,
    requests.exceptions.ChunkedEncodingError,
)

#: 4xx answers that store no outcome (the server released its claim): try again later.
RETRY_LATER = frozenset({408, 423, 425, 429})


@dataclass(frozen=True)
class Outcome:
    """The answer that settled one operation, under the key that every attempt sent."""

    response: requests.Response
    key: str
    attempts: int

    @property
    def replayed(self) -> bool:
        return is_replay(self.response)


class Unsettled(Exception):
    """An answer that says: send the same request again, with the same key, later."""

    def __init__(self, response: requests.Response) -> None:
        super().__init__(f"{response.status_code} {error_code(response)}")
        self.response = response


def is_replay(response: requests.Response) -> bool:
    """Whether the server answered from its record of an earlier attempt (which ran)."""
    value: str | None = response.headers.get("Idempotent-Replayed")
    return value == "true"


def error_code(response: requests.Response) -> str | None:
    """The refusal's ``code`` (DRF's error body or a problem detail), if it has one."""
    try:
        body = response.json()
    except ValueError:
        return None
    code = body.get("code") if isinstance(body, dict) else None
    return code if isinstance(code, str) else None


def retry_after(response: requests.Response) -> float | None:
    """Seconds the server asks us to wait: ``Retry-After`` as seconds or as an HTTP date."""
    value = response.headers.get("Retry-After", "").strip()
    if value.isdigit():
        return float(value)
    try:
        return email.utils.parsedate_to_datetime(value).timestamp() - time.time()
    except (TypeError, ValueError):
        return None


def settle(response: requests.Response) -> requests.Response:
    """Return an answer that settles the operation; ask stamina to retry one that does not."""
    status = response.status_code
    # The first attempt still runs: a retry gets its outcome once it ends. (A view's
    # own 409, a conflict of your API, is an answer: no code, or another one.)
    in_progress = status == 409 and error_code(response) == "idempotency_request_in_progress"
    # No outcome is stored yet: a retry runs the operation, or learns how it ended.
    unsettled = in_progress or status in RETRY_LATER or status >= 500
    # A replay is the stored outcome, whatever its status: it will not change.
    if unsettled and not is_replay(response):
        # Waits Retry-After plus jitter, at least; ends the retries if that passes the deadline.
        raise TryAgain(after=retry_after(response)) from Unsettled(response)
    return response


def send_idempotent(
    session: requests.Session,
    method: str,
    url: str,
    *,
    json: Any,
    key: str | None = None,
    deadline: float = 60.0,
    timeout: float = 10.0,
) -> Outcome:
    """Send one operation until an answer settles it or ``deadline`` seconds have passed.

    ``timeout`` bounds each attempt: requests has no timeout of its own.
    """
    key = key or str(uuid.uuid4())
    headers = {"Idempotency-Key": key}
    attempts = 0
    try:
        for attempt in stamina.retry_context(on=CONNECTION_ERRORS, attempts=None, timeout=deadline):
            with attempt:
                attempts = attempt.num
                response = session.request(method, url, json=json, headers=headers, timeout=timeout)
                settle(response)
    except Unsettled as last:
        response = last.response
    return Outcome(response, key, attempts)
