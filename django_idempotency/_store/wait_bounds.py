"""How long the store's statements may wait on other sessions, on PostgreSQL.

A session can hold a record's row, or an uncommitted version of it, for as
long as its worker is away: a worker cut off from the database between two
statements of its transaction keeps its locks until TCP keepalive or
``idle_in_transaction_session_timeout`` ends its session, minutes or hours
by default (docs/fleet.md). The statements a request waits in carry their
own bound: ``lock_timeout`` set with ``set_config(..., true)`` inside the
statement itself, evaluated before any lock is waited for, so that in
autocommit it lasts exactly as long as the statement's own transaction and
costs no round trip.

Off the hot path (takeovers, recovery) a bound never loosens a stricter one
already in force (``postgresql.conf``, ``ALTER ROLE``, the connection's
``OPTIONS``): the smaller of the two wins, 0 meaning none. The claim, sent
by every request, sets its bound as it is (``exactly()``): comparing with
the value in force measured 0.05-0.08 ms more per claim, about a tenth of
the statement, and the claim's own statement is all it lasts for.
"""

from __future__ import annotations

import functools
from datetime import timedelta


@functools.lru_cache(maxsize=64)  # a setting's value, at every claim
def milliseconds(wait: timedelta) -> str:
    """``wait`` as ``set_config()`` takes it: milliseconds, never 0 (which means "forever").

    At most PostgreSQL's largest ``lock_timeout`` (about 24.8 days), which a
    longer wait would make every bounded statement fail to set.
    """
    return str(min(max(1, round(wait.total_seconds() * 1000)), _LONGEST))


#: The largest ``lock_timeout`` PostgreSQL takes: a 32-bit int of milliseconds.
_LONGEST = 2**31 - 1


def at_most(setting: str) -> str:
    """SQL setting ``setting`` for this transaction to at most ``at_most_params()``'s value.

    An expression whose value is the new setting (text); two parameters.
    """
    current = f"current_setting('{setting}')"
    return (
        f"set_config('{setting}', CASE WHEN {current}::interval > interval '0' "
        f"AND {current}::interval <= make_interval(secs => %s::numeric / 1000) "
        f"THEN {current} ELSE %s END, true)"
    )


def at_most_params(wait: timedelta) -> list[str]:
    """The parameters of ``at_most()`` for a bound of ``wait``."""
    bound = milliseconds(wait)
    return [bound, bound]


def exactly(setting: str) -> str:
    """SQL setting ``setting`` for this transaction to one parameter (``milliseconds()``'s, say)."""
    return f"set_config('{setting}', %s, true)"
