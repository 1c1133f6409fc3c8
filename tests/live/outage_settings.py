"""Settings for the store outage tests: ``tests.settings`` plus IDEMPOTENCY from the environment.

``tests.settings`` reads only ``DATABASE_URL``; the outage tests also need
to run one gunicorn fail-closed and another with ``FAIL_OPEN``, with a
short lease, and (for ``FAIL_OPEN``) with the records on a database of
their own. So:

- ``IDEMPOTENCY_FAIL_OPEN=1``: ``IDEMPOTENCY["FAIL_OPEN"] = True``.
- ``IDEMPOTENCY_LEASE`` (seconds): ``IDEMPOTENCY["LEASE"]``. The outage
  tests use a few seconds, so that a claim whose owner lost the database
  mid-request (left CLAIMED: its release failed too) is taken over by a
  retry, or released by recovery, within the test's runtime.
- ``IDEMPOTENCY_RECORDS_DATABASE_URL``: a second alias ``records`` on that
  database and ``IDEMPOTENCY["DATABASE"] = "records"``. The default alias
  then runs with ``ATOMIC_REQUESTS``, so that the view's own writes roll
  back when storing the outcome on ``records`` fails (the protected run
  opens the view's transaction on both aliases; the records' block is
  the inner one and commits first).

The middleware is ``tests.settings``' own, on purpose: session and
authentication middleware are lazy, so an anonymous request without a
session cookie or token (all the outage tests send) reaches the
idempotency layer without any database access before the claim. The test
checks this holds: not one 500 while the store is down.
"""

from __future__ import annotations

import os

import dj_database_url

from tests.settings import *  # noqa: F403
from tests.settings import DATABASES

_CONNECT_TIMEOUT = 3

IDEMPOTENCY: dict[str, object] = {}
if os.environ.get("IDEMPOTENCY_FAIL_OPEN") == "1":
    IDEMPOTENCY["FAIL_OPEN"] = True
if os.environ.get("IDEMPOTENCY_LEASE"):
    IDEMPOTENCY["LEASE"] = float(os.environ["IDEMPOTENCY_LEASE"])

if DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
    # An unreachable server answers at once on localhost; this bounds the
    # wait if it does not (a stopped server's half-open sockets).
    DATABASES["default"].setdefault("OPTIONS", {})["connect_timeout"] = _CONNECT_TIMEOUT

_records_url = os.environ.get("IDEMPOTENCY_RECORDS_DATABASE_URL")
if _records_url:
    DATABASES["records"] = dj_database_url.parse(_records_url)
    DATABASES["records"]["OPTIONS"] = {"connect_timeout": _CONNECT_TIMEOUT}
    DATABASES["records"]["TEST"] = {"NAME": f"test_idempotency_records_{os.getpid()}"}
    DATABASES["default"]["ATOMIC_REQUESTS"] = True
    IDEMPOTENCY["DATABASE"] = "records"
