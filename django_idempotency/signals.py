"""Signals sent for each outcome, so projects can count them.

Every signal is sent with ``sender=IdempotencyRecord`` and the keyword
arguments ``request`` and ``scope`` (a ``Scope``: tenant, operation, key).
"""

from __future__ import annotations

from django.dispatch import Signal

#: This request won the claim and runs the view. Also: ``fencing_token``.
request_claimed = Signal()
#: The view's outcome was stored (``state``: COMPLETED or FAILED, ``status``).
response_stored = Signal()
#: A stored response was replayed (``status``).
response_replayed = Signal()
#: Refused with 409: another request holds the key (``state``).
request_in_flight = Signal()
#: Refused with 422: the key was used with different input.
key_reused = Signal()
#: The claim was given up so that a retry runs (``reason``: "exception" or
#: the retryable status code).
claim_released = Signal()
#: The record store could not be reached (``fail_open``: whether the view ran).
store_unavailable = Signal()
