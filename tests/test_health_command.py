"""``manage.py idempotency_health``: what it prints, its thresholds, and its exit status.

Through ``call_command`` on the suite's database (SQLite, PostgreSQL or
MariaDB), and once as a Kubernetes exec probe runs it: ``python -m django
idempotency_health`` in a process of its own, judged by its exit status.
Exit status: 0 healthy, 1 a threshold crossed, 2 a records database could
not be read, 3 a usage error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.db import connection, connections
from django.utils import timezone

from django_idempotency import census, recovery
from django_idempotency._store.database_time import DatabaseLater
from django_idempotency.models import IdempotencyRecord
from tests.utils import SHARD_TEST_ALIASES, database_url, record_in, routed_by_tenant, run_python

pytestmark = pytest.mark.django_db(transaction=True)
State = IdempotencyRecord.State
REPO = Path(__file__).resolve().parents[1]


def make(state: str, *, alias: str = "default", **fields: Any) -> IdempotencyRecord:
    if state not in (State.COMPLETED, State.FAILED):
        fields = {
            "lease_owner": "host:1:1",
            "lease_expires_at": timezone.now() + timedelta(minutes=2),
            "response_status": None,
            "response_body": None,
            "response_headers": [],
            **fields,
        }
    return record_in(alias, state=state, **fields)


def aged(record: IdempotencyRecord, **ago: timedelta) -> IdempotencyRecord:
    """Set ``record``'s time fields ``ago`` before the database's now."""
    IdempotencyRecord.objects.using(record._state.db).filter(pk=record.pk).update(
        **{name: DatabaseLater(-value) for name, value in ago.items()}
    )
    return record


def health(*args: str) -> tuple[int, str]:
    """The command's exit status and what it printed."""
    out = StringIO()
    try:
        call_command("idempotency_health", *args, stdout=out, stderr=StringIO())
    except SystemExit as exit:
        assert isinstance(exit.code, int)
        return exit.code, out.getvalue()
    return 0, out.getvalue()


def health_json(*args: str) -> tuple[int, dict[str, Any]]:
    status, printed = health("--format", "json", *args)
    return status, json.loads(printed)


def usage_error(*args: str) -> CommandError:
    with pytest.raises(CommandError) as raised:
        call_command("idempotency_health", *args, stdout=StringIO())
    assert raised.value.returncode == 3
    return raised.value


@pytest.fixture
def reconciled() -> Iterator[str]:
    operation = "POST health-test/reconciled"
    recovery.register_reconciler(operation)(lambda record: recovery.Release())
    yield operation
    del recovery._reconcilers[operation]


# --- the report -------------------------------------------------------------


def test_an_empty_store_is_healthy_and_says_so() -> None:
    status, printed = health()

    assert status == 0
    for state in State.values:
        assert f"  {state}" in printed
    assert "purge backlog: 0 record(s)" in printed
    assert "no reconciler" not in printed
    assert printed.rstrip().endswith("status: healthy")


def test_the_report_shows_counts_oldest_ages_backlog_and_missing_reconcilers(
    reconciled: str,
) -> None:
    aged(make(State.UNCERTAIN, operation="POST v1/refunds"), created_at=timedelta(hours=2))
    make(State.IN_PROGRESS, operation=reconciled)
    for _ in range(3):
        make(State.COMPLETED)
    aged(make(State.FAILED), expires_at=timedelta(hours=1))

    status, printed = health()

    assert status == 0  # no threshold given: a report, not a judgement
    lines = {line.split()[0]: line for line in printed.splitlines() if line.startswith("  ")}
    assert lines["UNCERTAIN"].split()[1] == "1"
    assert "oldest 2h" in lines["UNCERTAIN"]
    assert lines["IN_PROGRESS"].split()[1] == "1"
    assert lines["COMPLETED"].split()[1] == "3"
    assert lines["FAILED"].split()[1] == "1"
    assert "oldest" not in lines["COMPLETED"]
    assert "purge backlog: 1 record(s)" in printed
    assert "IN_PROGRESS or UNCERTAIN records: POST v1/refunds\n" in printed


def test_estimated_counts_say_about_and_a_capped_backlog_says_at_least(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(census, "EXACT_UP_TO", 2)
    monkeypatch.setattr(census, "BACKLOG_CAP", 2)
    for _ in range(12):
        aged(make(State.COMPLETED), expires_at=timedelta(hours=1))
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(f"ANALYZE {IdempotencyRecord._meta.db_table}")

    status, printed = health()

    assert status == 0
    completed = next(line for line in printed.splitlines() if "COMPLETED" in line)
    # SQLite has no planner estimate: its counts are exact.
    assert ("about" in completed) == (connection.vendor != "sqlite")
    assert "purge backlog: at least 2 record(s)" in printed


# --- thresholds ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("arguments", "crossed"),
    [
        (["--max-uncertain-age", "15m"], True),
        (["--max-uncertain-age", "2h"], False),
        (["--max-uncertain-age", "3600"], False),
        (["--max-unresolved-age", "30m"], True),
        (["--max-unresolved-age", "1d"], False),
        (["--max-uncertain", "1"], False),
        (["--max-uncertain", "0"], True),
        (["--max-purge-backlog", "1"], True),
        (["--max-purge-backlog", "2"], False),
        (["--fail-on-unreconciled"], True),
    ],
)
def test_each_threshold_exits_1_when_crossed_and_names_it(
    arguments: list[str], crossed: bool
) -> None:
    # One UNCERTAIN record 59 minutes old (no reconciler), two past retention.
    aged(make(State.UNCERTAIN, operation="POST v1/refunds"), created_at=timedelta(minutes=59))
    for _ in range(2):
        aged(make(State.COMPLETED), expires_at=timedelta(minutes=5))

    status, printed = health(*arguments)

    assert status == (1 if crossed else 0)
    named = "THRESHOLD CROSSED default: " in printed and f"({arguments[0]})" in printed
    assert named == crossed
    assert printed.rstrip().endswith("threshold crossed" if crossed else "status: healthy")


def test_every_crossed_threshold_is_listed(reconciled: str) -> None:
    aged(make(State.CLAIMED), created_at=timedelta(hours=5))
    make(State.UNCERTAIN, operation=reconciled)

    status, printed = health(
        "--max-unresolved-age", "1h", "--max-uncertain", "0", "--fail-on-unreconciled"
    )

    assert status == 1
    crossed = [line for line in printed.splitlines() if line.startswith("THRESHOLD CROSSED")]
    assert len(crossed) == 2  # the UNCERTAIN record's operation has a reconciler
    assert "oldest unresolved record 5h" in crossed[0] and "over 1h" in crossed[0]
    assert "1 UNCERTAIN record(s), over 0" in crossed[1]


def test_a_reconciler_registered_for_the_operation_clears_fail_on_unreconciled(
    reconciled: str,
) -> None:
    make(State.IN_PROGRESS, operation=reconciled)
    make(State.CLAIMED, operation="POST v1/orders")  # released without one

    assert health("--fail-on-unreconciled")[0] == 0


# --- usage errors -------------------------------------------------------------


@pytest.mark.parametrize("value", ["15", "900", "0.5", "15m", "1h30m", "2d", "90s", "1d2h3m4s"])
def test_durations_are_seconds_or_units(value: str) -> None:
    assert health("--max-uncertain-age", value)[0] == 0


@pytest.mark.parametrize("value", ["", "abc", "-5", "15x", "m", "1.5h", "15 m"])
def test_a_malformed_duration_is_a_usage_error(value: str) -> None:
    assert "not a duration" in str(usage_error("--max-uncertain-age", value))


@pytest.mark.parametrize("value", ["-1", "1.5", "many"])
def test_a_count_must_be_a_whole_number(value: str) -> None:
    usage_error("--max-uncertain", value)


def test_a_backlog_threshold_must_be_below_the_cap_the_backlog_is_counted_to() -> None:
    assert "below 100,000" in str(usage_error("--max-purge-backlog", "100000"))
    assert health("--max-purge-backlog", "99999")[0] == 0


def test_an_unknown_database_or_format_is_a_usage_error() -> None:
    assert "holds no idempotency records" in str(usage_error("--database", "nowhere"))
    usage_error("--format", "yaml")


# --- JSON ---------------------------------------------------------------------

KEYS = {
    "database",
    "error",
    "taken_at",
    "counts",
    "estimated",
    "oldest_age_seconds",
    "oldest_unresolved_age_seconds",
    "purge_backlog",
    "purge_backlog_capped",
    "unreconciled_operations",
}


def test_json_is_one_object_with_stable_keys() -> None:
    aged(make(State.UNCERTAIN, operation="POST v1/refunds"), created_at=timedelta(minutes=30))

    status, report = health_json("--max-uncertain-age", "10m")

    assert status == 1
    assert set(report) == {"status", "healthy", "databases", "crossed"}
    assert (report["status"], report["healthy"]) == (1, False)
    [database] = report["databases"]
    assert set(database) == KEYS
    assert database["database"] == "default" and database["error"] is None
    assert database["counts"] == {
        "CLAIMED": 0,
        "IN_PROGRESS": 0,
        "UNCERTAIN": 1,
        "COMPLETED": 0,
        "FAILED": 0,
    }
    assert database["estimated"] == []
    assert set(database["oldest_age_seconds"]) == {"CLAIMED", "IN_PROGRESS", "UNCERTAIN"}
    assert database["oldest_age_seconds"]["CLAIMED"] is None
    assert 1800 <= database["oldest_age_seconds"]["UNCERTAIN"] < 1830
    assert database["oldest_unresolved_age_seconds"] == database["oldest_age_seconds"]["UNCERTAIN"]
    assert (database["purge_backlog"], database["purge_backlog_capped"]) == (0, False)
    assert database["unreconciled_operations"] == ["POST v1/refunds"]
    [crossed] = report["crossed"]
    assert set(crossed) == {"database", "option", "limit", "value", "text"}
    assert (crossed["database"], crossed["option"], crossed["limit"]) == (
        "default",
        "--max-uncertain-age",
        600,
    )
    assert crossed["value"] >= 1800


def test_json_of_a_healthy_store() -> None:
    status, report = health_json()

    assert status == 0
    assert (report["status"], report["healthy"], report["crossed"]) == (0, True, [])


# --- several records databases, one unreadable -----------------------------------


@pytest.mark.django_db(databases=SHARD_TEST_ALIASES, transaction=True)
def test_an_unreadable_database_exits_2_and_the_others_are_still_reported_and_judged() -> None:
    table = IdempotencyRecord._meta.db_table
    with routed_by_tenant():
        make(State.UNCERTAIN, alias="shard_a")
        make(State.UNCERTAIN, alias="shard_b")
        broken = connections["shard_b"]
        with broken.cursor() as cursor:  # a shard whose table is gone: not migrated, say
            cursor.execute(f"ALTER TABLE {table} RENAME TO health_test_away")
        try:
            status, printed = health("--max-uncertain", "0")
            json_status, report = health_json("--max-uncertain", "0")
            only_a = health("--database", "shard_a", "--max-uncertain", "0")[0]
        finally:
            with broken.cursor() as cursor:
                cursor.execute(f"ALTER TABLE health_test_away RENAME TO {table}")

    # 2 wins over 1: an unread database may hide anything.
    assert (status, json_status, only_a) == (2, 2, 1)
    assert "shard_a (at " in printed
    assert "shard_b: COULD NOT BE READ (" in printed
    assert "THRESHOLD CROSSED shard_a: 1 UNCERTAIN record(s)" in printed
    shard_a, shard_b = report["databases"]
    assert (shard_a["database"], shard_a["error"], shard_a["counts"]["UNCERTAIN"]) == (
        "shard_a",
        None,
        1,
    )
    assert set(shard_b) == KEYS
    assert shard_b["database"] == "shard_b" and shard_b["error"]
    assert all(shard_b[key] is None for key in KEYS - {"database", "error", "oldest_age_seconds"})
    assert [crossed["database"] for crossed in report["crossed"]] == ["shard_a"]


# --- as a probe runs it -------------------------------------------------------------


def probe(*args: str) -> subprocess.CompletedProcess[str]:
    environment = {
        **os.environ,
        "DATABASE_URL": database_url(),
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, "-m", "django", "idempotency_health", *args],
        cwd=REPO,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_real_process_exits_with_the_status_a_probe_reads() -> None:
    aged(make(State.UNCERTAIN), created_at=timedelta(minutes=20))

    healthy = probe("--max-uncertain-age", "1h")
    crossed = probe("--max-uncertain-age", "15m")
    misused = probe("--max-uncertain-age", "soon")

    assert healthy.returncode == 0, healthy.stderr
    assert "UNCERTAIN" in healthy.stdout and healthy.stdout.rstrip().endswith("status: healthy")
    assert crossed.returncode == 1, crossed.stderr
    assert "THRESHOLD CROSSED default: oldest UNCERTAIN record 20m" in crossed.stdout
    # Not argparse's 2, which would read as "a database could not be read".
    assert misused.returncode == 3
    assert "not a duration" in misused.stderr


# ``idempotency_health``'s exit status when it cannot run at all.


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


#: Stored text a terminal would act on: clear the screen, home the cursor,
#: overwrite the line (CR), start a line of its own (LF), C1's CSI. Records
#: written before operation names were checked, or by hand, may hold it.
HOSTILE_OPERATION = "POST \x1b[2J\x1b[Hx\rstatus: healthy\nstatus: healthy\x9b0m"


def terminal_controls(printed: str) -> list[str]:
    """The characters of ``printed`` a terminal would act on, but the line ends."""
    return [char for char in printed if not char.isprintable() and char != "\n"]


def test_stored_text_is_printed_with_its_control_characters_escaped() -> None:
    make(State.UNCERTAIN, operation=HOSTILE_OPERATION)

    status, printed = health("--fail-on-unreconciled")

    assert status == 1
    assert terminal_controls(printed) == []
    assert "POST \\x1b[2J\\x1b[Hx\\rstatus: healthy\\nstatus: healthy\\x9b0m" in printed
    # No line of the report is the stored text's: the last one is the verdict.
    assert not [line for line in printed.splitlines() if line.startswith("status: healthy")]
    assert printed.splitlines()[-1] == "status: threshold crossed"


def test_json_gives_stored_text_as_it_is_stored() -> None:
    # JSON escapes control characters itself; a JSON reader gets the real name.
    make(State.UNCERTAIN, operation=HOSTILE_OPERATION)

    status, report = health_json("--fail-on-unreconciled")

    assert status == 1
    assert report["databases"][0]["unreconciled_operations"] == [HOSTILE_OPERATION]
