"""The payment provider's HTTP client (the simulator in ``testproject/provider``).

The base URL is the setting ``PAYMENTS_PROVIDER_URL`` (else the environment
variable of that name, else ``http://127.0.0.1:8765``); every call has a
timeout, ``PAYMENTS_PROVIDER_TIMEOUT`` seconds (default 10).

Errors say what is known about the charge:

- ``PaymentDeclined``: definitely not charged (402);
- ``ProviderRejected``: the provider refused the request itself (4xx);
- ``ProviderUnreachable``: no answer, a timeout or a 5xx. The charge may or
  may not have happened: only a lookup by idempotency id can tell.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import requests
from django.conf import settings

DEFAULT_URL = "http://127.0.0.1:8765"
DEFAULT_TIMEOUT = 10.0
CONNECT_TIMEOUT = 3.0


class ProviderError(Exception):
    """Base class of the client's errors."""


class ProviderUnreachable(ProviderError):
    """No usable answer: whether the charge happened is unknown."""


class PaymentDeclined(ProviderError):
    """The provider declined: nothing was charged."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class ProviderRejected(ProviderError):
    """The provider refused the request (invalid, or an idempotency mismatch)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code


@dataclass(frozen=True)
class Charge:
    id: str
    idempotency_id: str
    amount: int
    currency: str
    status: str
    created_at: str
    metadata: dict[str, Any] = field(default_factory=dict)
    attempts: int = 1

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Charge:
        return cls(
            id=data["id"],
            idempotency_id=data["idempotency_id"],
            amount=int(data["amount"]),
            currency=data["currency"],
            status=data["status"],
            created_at=data["created_at"],
            metadata=dict(data.get("metadata") or {}),
            attempts=int(data.get("attempts", 1)),
        )


def base_url() -> str:
    url = (
        getattr(settings, "PAYMENTS_PROVIDER_URL", None)
        or os.environ.get("PAYMENTS_PROVIDER_URL")
        or DEFAULT_URL
    )
    return str(url).rstrip("/")


def read_timeout() -> float:
    value = getattr(settings, "PAYMENTS_PROVIDER_TIMEOUT", None) or os.environ.get(
        "PAYMENTS_PROVIDER_TIMEOUT"
    )
    return float(value) if value else DEFAULT_TIMEOUT


def _timeouts() -> tuple[float, float]:
    return (CONNECT_TIMEOUT, read_timeout())


def _error_of(response: requests.Response) -> tuple[str, str]:
    try:
        error = response.json().get("error") or {}
        return str(error.get("code", "")), str(error.get("message", ""))
    except (ValueError, AttributeError):
        return "", response.text[:200]


def create_charge(
    idempotency_id: str,
    amount: int,
    currency: str,
    *,
    metadata: dict[str, Any] | None = None,
    simulate: str | None = None,
    simulate_delay: str | None = None,
) -> Charge:
    """Charge ``amount`` once per ``idempotency_id``; a repeat returns the same charge.

    ``simulate`` / ``simulate_delay`` ask the simulator for one of its
    failure modes (``X-Simulate``, ``X-Simulate-Delay``).
    """
    headers = {}
    if simulate:
        headers["X-Simulate"] = simulate
    if simulate_delay:
        headers["X-Simulate-Delay"] = simulate_delay
    payload: dict[str, Any] = {
        "idempotency_id": idempotency_id,
        "amount": amount,
        "currency": currency,
        "metadata": metadata or {},
    }
    try:
        response = requests.post(
            f"{base_url()}/charges", json=payload, headers=headers, timeout=_timeouts()
        )
    except requests.RequestException as exc:
        raise ProviderUnreachable(f"POST /charges: {type(exc).__name__}: {exc}") from exc
    if response.status_code in (200, 201):
        return Charge.from_json(response.json())
    code, message = _error_of(response)
    if response.status_code == 402:
        raise PaymentDeclined(code or "card_declined", message or "The card was declined.")
    if 400 <= response.status_code < 500:
        raise ProviderRejected(response.status_code, code, message)
    raise ProviderUnreachable(f"POST /charges answered {response.status_code} {code} {message}")


def find_charge(idempotency_id: str) -> Charge | None:
    """The charge made for ``idempotency_id``, or ``None`` if there is none."""
    try:
        response = requests.get(
            f"{base_url()}/charges/{quote(idempotency_id, safe='')}", timeout=_timeouts()
        )
    except requests.RequestException as exc:
        raise ProviderUnreachable(f"GET /charges: {type(exc).__name__}: {exc}") from exc
    if response.status_code == 404:
        return None
    if response.status_code != 200:
        code, message = _error_of(response)
        raise ProviderUnreachable(f"GET /charges answered {response.status_code} {code} {message}")
    return Charge.from_json(response.json())


def ledger() -> list[Charge]:
    """Every charge the provider holds (the simulator's test endpoint)."""
    try:
        response = requests.get(f"{base_url()}/ledger", timeout=_timeouts())
        response.raise_for_status()
    except requests.RequestException as exc:
        raise ProviderUnreachable(f"GET /ledger: {type(exc).__name__}: {exc}") from exc
    return [Charge.from_json(charge) for charge in response.json()["charges"]]


# -- two steps: authorize, then capture (payments/two_step.py) ------------------------------
#
# The simulator knows one kind of ledger entry; an authorization and a capture
# are each an entry of their own, told apart by ``metadata["step"]``, each
# created at most once per idempotency id, as a real provider's
# "authorize" and "capture" calls are (Stripe: a PaymentIntent with
# ``capture_method=manual``, then its capture).


def authorize(
    idempotency_id: str, amount: int, currency: str, *, metadata: dict[str, Any]
) -> Charge:
    """Hold ``amount`` on the card, once per ``idempotency_id``; a repeat returns it."""
    return create_charge(
        idempotency_id, amount, currency, metadata={**metadata, "step": "authorize"}
    )


def capture(
    idempotency_id: str,
    authorization_id: str,
    amount: int,
    currency: str,
    *,
    metadata: dict[str, Any],
) -> Charge:
    """Capture the authorization ``authorization_id``, once per ``idempotency_id``."""
    return create_charge(
        idempotency_id,
        amount,
        currency,
        metadata={**metadata, "step": "capture", "authorization": authorization_id},
    )
