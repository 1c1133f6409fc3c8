"""Second review of issue 17: the admin overview page's figures and labels."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from datetime import UTC, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
from django.test import override_settings

from django_idempotency._store.database_time import database_now
from django_idempotency.models import IdempotencyRecord
from tests.test_admin_overview import OVERVIEW, record, viewer
from tests.test_health_command import database_url
from tests.test_scale_out_edge_cases import database_time_zone, mysql_only

pytestmark = pytest.mark.django_db(transaction=True)
State = IdempotencyRecord.State
REPO = Path(__file__).resolve().parent.parent
# Half an hour off UTC: a local hour is never a UTC hour.
KOLKATA = "Asia/Kolkata"


def hourly_bar_titles(html: str) -> list[str]:
    svg = html.split('id="idempotency-hourly"')[1].split("</svg>")[0]
    return re.findall(r"<rect [^>]*><title>([^<]*)</title>", svg)


def test_without_time_zone_support_an_hour_labelled_utc_is_a_utc_hour() -> None:
    """USE_TZ=False, TIME_ZONE="Asia/Kolkata": the records hold Kolkata's wall clock.

    The chart truncates them to Kolkata's hours (Trunc with no tzinfo) and
    labels each bar "HH:00 UTC" (admin_overview.hourly_chart; the x axis
    says "hour created (UTC)"): a record created at 10:10 in Kolkata (04:40
    UTC) is drawn in a bar titled "10:00 UTC".
    """
    with override_settings(USE_TZ=False, TIME_ZONE=KOLKATA):
        now = database_now("default")
        assert now.tzinfo is None
        created = (now - timedelta(hours=3)).replace(minute=10, second=0, microsecond=0)
        record(created, State.COMPLETED)
        page = viewer("view_idempotencyrecord").get(OVERVIEW)

    assert page.status_code == 200
    html = page.content.decode()
    [title] = hourly_bar_titles(html)
    found = re.match(r"(\d{4}-\d\d-\d\d \d\d):00 (\S+): ", title)
    assert found is not None, title
    shown_hour, zone = found.groups()
    local = created.replace(tzinfo=ZoneInfo(KOLKATA))
    if zone == "UTC":
        assert shown_hour == f"{local.astimezone(UTC):%Y-%m-%d %H}", title
    else:  # labelled in the site's zone: then its hour
        assert shown_hour == f"{local:%Y-%m-%d %H}", title
    assert "hour created (UTC)" not in html or zone == "UTC"


@pytest.mark.postgres
def test_the_sampled_chart_of_a_postgresql_records_database_beside_another_default(
    tmp_path: Path,
) -> None:
    """``IDEMPOTENCY["DATABASE"]`` names a PostgreSQL alias; ``default`` is another engine.

    The sampled path (``overview._per_hour_and_state``, and ``_planner_rows``)
    takes its SQL from ``Query.sql_with_params()``, which compiles for
    ``DEFAULT_DB_ALIAS`` whatever ``.using()`` said: the hour's truncation
    comes out as SQLite's ``django_datetime_trunc(...)`` (or MySQL's
    ``DATE_FORMAT``) and PostgreSQL refuses it, a 500 on the overview once
    the window holds more than ``EXACT_WINDOW_UP_TO`` records.
    """
    now = database_now("default")
    for _ in range(2):
        record(now - timedelta(hours=2), State.COMPLETED)
    (tmp_path / "review2_settings.py").write_text(
        textwrap.dedent(
            f"""
            import dj_database_url
            from tests.settings import *  # noqa: F403

            DATABASES["records"] = dj_database_url.parse({database_url()!r})
            IDEMPOTENCY = {{"DATABASE": "records"}}
            """
        )
    )
    code = """
        import django

        django.setup()
        from django_idempotency._admin import figures as overview
        from django_idempotency._store.database_time import database_now

        overview.EXACT_WINDOW_UP_TO = 0  # the window is "large": sampled
        hourly = overview.hourly_counts("records", database_now("records"))
        print(hourly.sample_percent, hourly.total("COMPLETED"))
    """
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO,
        env={
            **os.environ,
            "DATABASE_URL": "",  # default: SQLite
            "TEST_SQLITE_PATH": str(tmp_path / "default.sqlite3"),
            "DJANGO_SETTINGS_MODULE": "review2_settings",
            "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)]),
        },
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )

    assert done.returncode == 0, done.stderr[-1500:]
    assert done.stdout.split() == ["100.0", "2"], done.stdout


@mysql_only
def test_a_mysql_database_storing_local_times_without_time_zone_tables_still_has_its_page() -> None:
    """``DATABASES["default"]["TIME_ZONE"] = "Europe/Paris"`` on MariaDB (supported: W007).

    The hourly chart truncates with ``Trunc(tzinfo=UTC)``, which Django
    writes as ``CONVERT_TZ(created_at, 'Europe/Paris', 'UTC')``: NULL on a
    server whose time zone tables were never loaded (MariaDB's and MySQL's
    default; this machine's MariaDB 10.11 too), and Django's ``Trunc``
    raises "Database returned an invalid datetime value": the page is a 500,
    where the changelist (its date hierarchy included) works. (Truncate in
    the connection's own zone, ``tzinfo=connection.timezone``, which needs
    no CONVERT_TZ, and convert the hours in Python.)
    """
    with database_time_zone("default", "Europe/Paris"):
        now = database_now("default")
        record(now - timedelta(hours=3), State.COMPLETED)
        page = viewer("view_idempotencyrecord").get(OVERVIEW)

    assert page.status_code == 200
    assert hourly_bar_titles(page.content.decode()), "the record is in no bar"


@pytest.mark.parametrize("language", ["de", "fr", "pt-br"])
def test_the_charts_geometry_is_svg_numbers_in_any_language(language: str) -> None:
    """The admin in German, French, Brazilian Portuguese (``LANGUAGE_CODE``).

    ``svg_chart.html`` writes the bars' and ticks' floats (``x="70.5"``)
    with ``{{ }}``, which localizes them: ``x="70,5"`` where the decimal
    separator is a comma, which SVG does not read (the bars are drawn at 0
    or not at all, Chromium logs "Expected length"). ``{% localize off %}``
    or ``|unlocalize`` around the geometry.
    """
    now = database_now("default")
    for hours_ago, state in [(2, State.COMPLETED), (3, State.FAILED), (5, State.UNCERTAIN)]:
        record(now - timedelta(hours=hours_ago, minutes=20), state)

    with override_settings(LANGUAGE_CODE=language):
        page = viewer("view_idempotencyrecord").get(OVERVIEW)

    assert page.status_code == 200
    html = page.content.decode()
    figures = re.findall(r'<figure class="idempotency-chart".*?</figure>', html, re.S)
    svgs = [svg for figure in figures for svg in re.findall(r"<svg .*?</svg>", figure, re.S)]
    assert len(figures) == 2 and svgs
    geometry = re.compile(r'\b(x|y|x1|x2|y1|y2|width|height|dy)="([^"]*)"')
    odd = {
        f"{name}={value}"
        for svg in svgs
        for name, value in geometry.findall(svg)
        if not re.fullmatch(r"-?\d+(\.\d+)?(em)?", value)
    }
    assert not odd, sorted(odd)[:10]
