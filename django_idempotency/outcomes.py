"""Outcome policies: which answers are stored, which release the claim, which are uncertain.

An outcome policy is a callable taking the view's finished response and
returning a ``Verdict``; ``@idempotent(outcome=...)`` picks one per view.
``standard`` is the default for keys a client sends in the
``Idempotency-Key`` header, ``webhook`` for keys read from anywhere else
(``key=``): a webhook's sender redelivers whatever it did not see succeed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from rest_framework.exceptions import ParseError, UnsupportedMediaType, ValidationError

from django_idempotency.responses import Verdict, verdict_of

if TYPE_CHECKING:
    from django.http import HttpResponseBase

__all__ = [
    "INPUT_REFUSALS",
    "Outcome",
    "Verdict",
    "by_status",
    "input_refused",
    "mark_input_refused",
    "standard",
    "webhook",
]

Outcome = Callable[["HttpResponseBase"], Verdict]
"""An outcome policy: given the view's finished response, its ``Verdict``."""

INPUT_REFUSALS = (ValidationError, ParseError, UnsupportedMediaType)
"""DRF exceptions that refuse a request's input.

Raised by a protected DRF view, their 400 (or 415) is not stored by
``standard``: the client may correct the body and retry with the same key.
"""

_INPUT_REFUSED = "_idempotency_input_refused"


def mark_input_refused(response: HttpResponseBase) -> None:
    """Note on ``response`` that it answers one of the ``INPUT_REFUSALS`` (``decorators``)."""
    setattr(response, _INPUT_REFUSED, True)


def input_refused(response: HttpResponseBase) -> bool:
    """Whether ``response`` answers a DRF input refusal the view raised."""
    return bool(getattr(response, _INPUT_REFUSED, False))


def standard(response: HttpResponseBase) -> Verdict:
    """The default for ``Idempotency-Key`` clients: the behaviour table of docs/http.md.

    An input refusal raised by a DRF view (``INPUT_REFUSALS``) releases the
    claim; otherwise ``responses.verdict_of``: 5xx, 408, 409, 423, 425 and 429
    release the claim, any other 4xx is stored as FAILED, the rest as
    COMPLETED.
    """
    if input_refused(response):
        return Verdict.RELEASE
    return verdict_of(response.status_code)


def webhook(response: HttpResponseBase) -> Verdict:
    """The default for keys read from elsewhere (``key=``): only 2xx answers are stored.

    A webhook's sender retries every delivery it did not see succeed, and
    each retry must run again: any other answer releases the claim.
    """
    return Verdict.COMPLETED if 200 <= response.status_code < 300 else Verdict.RELEASE


def by_status(verdicts: Mapping[int | range, Verdict], otherwise: Outcome = standard) -> Outcome:
    """A policy deciding by status: ``verdicts`` first, else ``otherwise``.

    ``by_status({502: Verdict.UNCERTAIN, 504: Verdict.UNCERTAIN})`` leaves a
    record UNCERTAIN for a reconciler when the view answers that its
    provider failed or timed out, even without ``begin_external()``;
    ``by_status({range(400, 500): Verdict.RELEASE})`` stores no 4xx.

    Args:
        verdicts: Statuses (an ``int`` or a ``range``) and their verdicts;
            an ``int`` wins over a ``range`` holding it.
        otherwise: The policy for the other statuses.

    Returns:
        The policy, for ``@idempotent(outcome=...)``.
    """
    exact = {status: verdict for status, verdict in verdicts.items() if isinstance(status, int)}
    ranges = [
        (status, verdict) for status, verdict in verdicts.items() if isinstance(status, range)
    ]
    for verdict in verdicts.values():
        if not isinstance(verdict, Verdict):
            raise TypeError(f"by_status() takes Verdict values, not {verdict!r}.")

    def outcome(response: HttpResponseBase) -> Verdict:
        status = response.status_code
        if status in exact:
            return exact[status]
        for statuses, verdict in ranges:
            if status in statuses:
                return verdict
        return otherwise(response)

    return outcome
