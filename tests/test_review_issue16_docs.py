"""Review of issue 16: the pages that list what the package sets on the server.

Issue 16 added two transaction-local settings: the takeover's
``lock_timeout`` (store/conditional.py) and recovery's
``idle_in_transaction_session_timeout`` (store/maintenance.py). The pages
that tell an operator what the package sets were not updated:

- (fixed) docs/pgbouncer.md says "The only setting it changes is
  ``lock_timeout``, for the ``single_transaction`` claim"; it does not name
  ``idle_in_transaction_session_timeout`` at all (a pooler or an audit that
  watches GUC changes meets both).
- (fixed) docs/settings.md's ``IN_FLIGHT_WAIT`` row names the wait mode and
  the single-transaction and optimistic claims, not the takeover's bound on
  a locked row (a retry's 409 after IN_FLIGHT_WAIT) nor recovery's
  idle-in-transaction bound.

The settings are read from the code (every ``set_config('<name>'`` and
``wait_bounds.at_most('<name>')`` in the package), not copied here.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "django_idempotency"
DOCS = ROOT / "docs"


def _settings_the_package_sets() -> set[str]:
    found: set[str] = set()
    for source in PACKAGE.rglob("*.py"):
        text = source.read_text()
        found |= set(re.findall(r"(?:set_config|at_most)\('([a-z_]+)'", text))
    return found


def test_the_pgbouncer_page_names_every_setting_the_package_sets() -> None:
    page = (DOCS / "pgbouncer.md").read_text()
    assert _settings_the_package_sets() >= {"lock_timeout", "idle_in_transaction_session_timeout"}
    missing = {name for name in _settings_the_package_sets() if name not in page}
    assert not missing, f"docs/pgbouncer.md does not name {sorted(missing)}"
    assert "The only setting it changes is `lock_timeout`" not in page


def test_the_in_flight_wait_row_says_what_it_bounds() -> None:
    (row,) = [
        line
        for line in (DOCS / "settings.md").read_text().splitlines()
        if line.startswith("| `IN_FLIGHT_WAIT`")
    ]
    assert "takeover" in row or "taken over" in row, row
    assert "recovery" in row, row
