"""Review of issue 17: ``idempotency_health``'s exit status when it cannot run at all."""

from __future__ import annotations

import pytest

from tests.test_review_issue17_prometheus import run_python

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_records_database_that_is_not_configured_is_not_read_as_a_threshold_crossed() -> None:
    """``IDEMPOTENCY["DATABASE"]`` names an alias DATABASES lacks (a typo, a missing env var).

    The command skips the system checks (which would report it), and
    ``take_census`` raises ``ConnectionDoesNotExist``, which is no
    ``DatabaseError``: the traceback escapes and Python exits 1, the status
    docs/commands.md gives to "a threshold was crossed". A probe or a cron
    job reads a broken configuration as a full store. Expected: 2 (the
    records database could not be read) or 3 (a usage error).
    """
    result = run_python(
        """
        import django
        django.setup()
        from django.conf import settings
        from django.core.management import execute_from_command_line
        settings.IDEMPOTENCY = {"DATABASE": "records_typo"}
        execute_from_command_line(["manage.py", "idempotency_health"])
        """
    )
    assert result.returncode in (2, 3), (result.returncode, result.stderr[-2000:])
