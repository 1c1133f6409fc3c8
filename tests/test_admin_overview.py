"""The admin's overview page: its figures are the records', and it stays cheap.

Records are made at known times (relative to the database's clock), so that
the hourly counts, the age buckets and the oldest records can be compared
with what was inserted, on whichever database the suite runs (SQLite,
PostgreSQL, MariaDB).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from django.contrib.auth.models import Permission
from django.db import connection
from django.test import Client, override_settings
from django.test.utils import CaptureQueriesContext

from django_idempotency._admin import figures as overview
from django_idempotency._admin import overview as admin_overview
from django_idempotency._admin.charts import Series, bar_chart, compact_number, nice_ceiling
from django_idempotency._admin.figures import UNRESOLVED, hourly_counts, unresolved_ages
from django_idempotency._store.database_time import database_now
from django_idempotency.census import Census, take_census
from django_idempotency.models import IdempotencyRecord
from tests.factories import RecordFactory, UserFactory
from tests.test_scale_out_edge_cases import database_time_zone, mysql_only
from tests.utils import SHARD_TEST_ALIASES, database_url, record_in, routed_by_tenant

pytestmark = pytest.mark.django_db(transaction=True)
State = IdempotencyRecord.State
CHANGELIST = "/admin/django_idempotency/idempotencyrecord/"
OVERVIEW = f"{CHANGELIST}overview/"


def viewer(*codenames: str) -> Client:
    user = UserFactory.create(is_staff=True)
    user.user_permissions.add(
        *Permission.objects.filter(
            content_type__app_label="django_idempotency", codename__in=codenames
        )
    )
    client = Client()
    client.force_login(user)
    return client


def hour_of(moment: datetime) -> datetime:
    return moment.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


def record(created_at: datetime, state: str = State.COMPLETED, **fields: Any) -> IdempotencyRecord:
    unresolved = state not in (State.COMPLETED, State.FAILED)
    values: dict[str, Any] = {
        "state": state,
        "created_at": created_at,
        "updated_at": created_at,
        "expires_at": created_at + timedelta(days=3),
    }
    if unresolved:
        values.update(
            response_status=None,
            response_body=None,
            response_headers=[],
            lease_expires_at=created_at + timedelta(minutes=2),
            lease_owner="web-1:1",
        )
    return RecordFactory.create(**{**values, **fields})


def inserted_at_known_hours(now: datetime) -> dict[tuple[datetime, str], int]:
    """Records in several hours of the window (and two outside it); the expected counts."""
    this_hour = hour_of(now)
    # (hours before the current hour, minutes into that hour, state, how many)
    plan = [
        (1, 1, State.COMPLETED, 3),
        (1, 59, State.FAILED, 2),
        (1, 30, State.UNCERTAIN, 1),
        (5, 0, State.COMPLETED, 4),
        (5, 10, State.CLAIMED, 1),
        (5, 20, State.IN_PROGRESS, 2),
        (30, 45, State.FAILED, 1),
        (47, 0, State.COMPLETED, 2),  # the first hour of the window, its first moment
        (47, 59, State.UNCERTAIN, 1),
    ]
    expected: dict[tuple[datetime, str], int] = {}
    for back, minutes, state, count in plan:
        hour = this_hour - timedelta(hours=back)
        for _ in range(count):
            record(hour + timedelta(minutes=minutes), state)
        series = state if state in (State.COMPLETED, State.FAILED) else UNRESOLVED
        expected[hour, series] = expected.get((hour, series), 0) + count
    # Before the window: counted by the census, in no hour of the chart.
    before = this_hour - timedelta(hours=47, microseconds=1)
    record(before, State.COMPLETED)
    record(before, State.UNCERTAIN)
    return expected


def as_dict(hourly: overview.HourlyCounts) -> dict[tuple[datetime, str], int]:
    return {
        (hour, series): count
        for series, counts in hourly.counts.items()
        for hour, count in zip(hourly.hours, counts, strict=True)
        if count
    }


# -- the figures --------------------------------------------------------------------------


def test_hourly_counts_per_state_are_what_was_inserted() -> None:
    now = database_now("default")
    expected = inserted_at_known_hours(now)

    hourly = hourly_counts("default", now)

    assert hourly.sample_percent is None  # a handful of records: counted
    assert len(hourly.hours) == overview.HOURS == 48
    assert hourly.hours[-1] == hour_of(now)
    assert hourly.hours[0] == hour_of(now) - timedelta(hours=47)
    assert as_dict(hourly) == expected
    assert hourly.total(State.COMPLETED) == 9
    assert hourly.total(UNRESOLVED) == 5


def test_a_record_of_the_current_hour_is_in_the_last_bar() -> None:
    now = database_now("default")
    record(now - timedelta(seconds=1), State.FAILED)

    hourly = hourly_counts("default", now)

    # Unless the hour began within the last second: then the bar before it.
    counts = hourly.counts[State.FAILED]
    assert counts[-1] + counts[-2] == 1 and sum(counts) == 1


@pytest.mark.postgres
def test_sampled_hourly_counts_scale_a_tablesample_up(monkeypatch: pytest.MonkeyPatch) -> None:
    now = database_now("default")
    expected = inserted_at_known_hours(now)
    # Every window is "large": sampled, here all of the table's pages (100 %).
    monkeypatch.setattr(overview, "EXACT_WINDOW_UP_TO", 0)
    with CaptureQueriesContext(connection) as queries:
        whole = hourly_counts("default", now)

    assert whole.sample_percent == 100.0
    assert any("TABLESAMPLE SYSTEM (100.000000)" in q["sql"] for q in queries.captured_queries)
    assert as_dict(whole) == expected

    # A quarter of the pages: each count found is scaled up four times. (The
    # table has a page or two, so the sample holds all of a page or none.)
    monkeypatch.setattr(overview, "SAMPLED_ROWS", 1)
    monkeypatch.setattr(overview, "_planner_rows", lambda records: 4)
    quarter = hourly_counts("default", now)

    assert quarter.sample_percent == 25.0
    for state in (State.COMPLETED, State.FAILED):
        for hour, count in zip(quarter.hours, quarter.counts[state], strict=True):
            assert count % 4 == 0 and count <= 4 * expected.get((hour, state), 0)
    # The unresolved ones are always counted exactly.
    assert quarter.counts[UNRESOLVED] == whole.counts[UNRESOLVED]


@pytest.mark.postgres
def test_the_page_says_when_the_chart_is_estimated(monkeypatch: pytest.MonkeyPatch) -> None:
    record(database_now("default") - timedelta(hours=2))
    monkeypatch.setattr(overview, "EXACT_WINDOW_UP_TO", 0)

    page = viewer("view_idempotencyrecord").get(OVERVIEW)

    assert page.status_code == 200
    assert "estimated from a 100% sample" in page.content.decode()


def test_ages_of_unresolved_records_fall_in_their_buckets() -> None:
    now = database_now("default")
    for age in (
        timedelta(seconds=20),
        timedelta(minutes=3),
        timedelta(minutes=4),
        timedelta(minutes=30),
        timedelta(hours=5),
        timedelta(days=3),
    ):
        record(now - age, State.UNCERTAIN)
    record(now - timedelta(seconds=20), State.COMPLETED)  # resolved: not in the chart

    ages = unresolved_ages("default", now)

    assert ages.labels == ("< 1 min", "< 5 min", "< 1 h", "< 1 day", "older")
    assert ages.counts == (1, 2, 1, 1, 1)


def test_oldest_unresolved_records_oldest_first() -> None:
    now = database_now("default")
    keys = [f"stuck-{n}" for n in range(12)]
    for n, key in enumerate(keys):
        record(now - timedelta(hours=30 - n), State.UNCERTAIN, key=key)
    record(now - timedelta(days=2), State.COMPLETED, key="old-but-resolved")

    oldest = overview.oldest_unresolved("default")

    assert [r.key for r in oldest] == keys[: overview.OLDEST_SHOWN]


# -- the page -----------------------------------------------------------------------------


def census_counts(html: str) -> dict[str, int]:
    return {
        state: int(count)
        for state, count in re.findall(r'data-state="(\w+)" data-count="(\d+)"', html)
    }


def test_the_page_shows_counts_charts_and_the_oldest_records() -> None:
    now = database_now("default")
    # Hours away from the window's edges: the page reads the clock again.
    for hours_ago, state, count in [
        (2, State.COMPLETED, 4),
        (3, State.FAILED, 2),
        (1, State.CLAIMED, 1),
        (5, State.IN_PROGRESS, 2),
    ]:
        for _ in range(count):
            record(now - timedelta(hours=hours_ago), state)
    oldest = record(now - timedelta(days=3), State.UNCERTAIN, key="the-oldest")

    page = viewer("view_idempotencyrecord").get(OVERVIEW)

    assert page.status_code == 200
    html = page.content.decode()
    assert census_counts(html) == {
        "CLAIMED": 1,
        "IN_PROGRESS": 2,
        "UNCERTAIN": 1,
        "COMPLETED": 4,
        "FAILED": 2,
    }
    assert html.count("<svg") >= 2 and 'id="idempotency-hourly-title"' in html
    assert '<title id="idempotency-ages-title">Ages of unresolved records</title>' in html
    # Each bar carries its figure; the hourly bars add up to the window's records.
    hourly_svg = html.split('id="idempotency-hourly"')[1].split("</svg>")[0]
    totals: dict[str, int] = {}
    for series, value in re.findall(r'data-series="(\w+)" data-value="(\d+)"', hourly_svg):
        totals[series] = totals.get(series, 0) + int(value)
    assert totals == {"COMPLETED": 4, "FAILED": 2, UNRESOLVED: 3}
    oldest_rows = html.split('id="idempotency-oldest"')[1].split("</table>")[0]
    assert oldest_rows.index(">the-oldest</a>") < oldest_rows.index("<td>claimed</td>")
    assert f'href="{CHANGELIST}{oldest.pk}/change/">the-oldest</a>' in html
    assert "Purge backlog" in html and "estimated from a" not in html


def test_the_page_counts_stuck_records_first_postponed_uncertain_ones_included() -> None:
    """In an outage recovery postpones UNCERTAIN records: they still need attention."""
    now = database_now("default")
    record(  # its owner at work: not stuck
        now - timedelta(hours=1), State.IN_PROGRESS, lease_expires_at=now + timedelta(minutes=1)
    )
    record(  # recovery asks the reconciler again in five minutes
        now - timedelta(hours=2),
        State.UNCERTAIN,
        key="postponed",
        lease_owner="",
        lease_expires_at=now + timedelta(minutes=5),
    )
    record(  # its owner died: recovery takes it at its next run
        now - timedelta(hours=3), State.CLAIMED, lease_expires_at=now - timedelta(minutes=1)
    )

    html = viewer("view_idempotencyrecord").get(OVERVIEW).content.decode()

    header = html.split('id="idempotency-census"')[1].split("</thead>")[0]
    assert re.search(r"<tr><th[^>]*>Stuck</th>", header)
    stuck = r'class="number census-stuck" data-count="2"><a href="[^"]*\?state=stuck"'
    assert re.search(stuck, html)
    oldest_rows = html.split('id="idempotency-oldest"')[1].split("</table>")[0]
    postponed = oldest_rows.split(">postponed</a>")[1].split("</tr>")[0]
    assert postponed.endswith("<td>postponed</td>")


def test_the_changelist_links_to_the_overview() -> None:
    page = viewer("view_idempotencyrecord").get(CHANGELIST)

    assert page.status_code == 200
    assert f'href="{OVERVIEW}" class="idempotency-overview-link"' in page.content.decode()


def test_the_page_renders_without_records() -> None:
    page = viewer("view_idempotencyrecord").get(OVERVIEW)

    assert page.status_code == 200
    html = page.content.decode()
    assert set(census_counts(html).values()) == {0}
    assert "No unresolved records." in html
    assert 'id="idempotency-hourly"' in html and "data-value=" not in html


def test_a_user_without_the_view_permission_is_refused() -> None:
    assert viewer().get(OVERVIEW).status_code == 403
    assert viewer("reconcile_idempotencyrecord").get(OVERVIEW).status_code == 403


def test_an_anonymous_visitor_is_sent_to_log_in() -> None:
    page = Client().get(OVERVIEW)

    assert page.status_code == 302 and page["Location"].startswith("/admin/login/")


def test_the_page_costs_the_census_and_four_queries_however_many_records() -> None:
    client = viewer("view_idempotencyrecord")
    client.get(OVERVIEW)
    with CaptureQueriesContext(connection) as empty:
        client.get(OVERVIEW)
    inserted_at_known_hours(database_now("default"))
    with CaptureQueriesContext(connection) as census:
        take_census("default")
    with CaptureQueriesContext(connection) as filled:
        assert client.get(OVERVIEW).status_code == 200

    # The session, the user and their permissions (two); then the census; then
    # the unresolved and resolved records per hour, the ages, the oldest.
    expected = 4 + len(census.captured_queries) + 4
    shown = "\n".join(q["sql"][:90] for q in filled.captured_queries)
    assert len(filled.captured_queries) == len(empty.captured_queries) == expected, shown


def test_estimated_counts_read_about_and_a_capped_backlog_at_least() -> None:
    taken_at = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
    census = Census(
        database="default",
        taken_at=taken_at,
        counts={
            "CLAIMED": 0,
            "IN_PROGRESS": 0,
            "UNCERTAIN": 2,
            "COMPLETED": 9_512_345,
            "FAILED": 31,
        },
        estimated=frozenset({"COMPLETED"}),
        oldest={"UNCERTAIN": taken_at - timedelta(hours=3)},
        purge_backlog=100_000,
        purge_backlog_capped=True,
        unreconciled_operations=("POST v1/payouts",),
    )

    row = admin_overview.census_row(census, several=False)

    shown = {state["value"]: state["shown"] for state in row["states"]}
    assert shown["COMPLETED"] == "about 9,512,345"
    assert shown["FAILED"] == "31" and shown["UNCERTAIN"] == "2"
    assert row["purge_backlog"] == "at least 100,000"
    assert row["oldest_unresolved"] == "3\xa0hours"
    assert row["unreconciled_operations"] == ("POST v1/payouts",)


# -- the charts ---------------------------------------------------------------------------


def test_round_axis_ceilings() -> None:
    assert [nice_ceiling(v) for v in (0, 1, 3, 7, 11, 26, 55, 61, 999, 4_100)] == [
        1,
        1,
        3,
        8,
        20,
        30,
        60,
        80,
        1000,
        5000,
    ]
    assert [compact_number(v) for v in (0, 950, 1200, 3_000_000)] == ["0", "950", "1.2k", "3M"]


def test_stacked_bars_have_heights_in_proportion() -> None:
    chart = bar_chart(
        identifier="test",
        title="t",
        description="d",
        categories=["a", "b"],
        series=[Series("low", "low", "c1", [10, 0]), Series("high", "high", "c2", [30, 20])],
        x_axis_label="x",
        y_axis_label="y",
    )

    low, high_a, high_b = chart.bars  # no bar for a zero
    assert (low.series, high_a.series, high_b.series) == ("low", "high", "high")
    assert high_a.y + high_a.height == pytest.approx(low.y)  # stacked on top
    assert high_a.height == pytest.approx(3 * low.height)
    assert high_b.height == pytest.approx(2 * low.height)
    assert low.y + low.height == chart.bottom and high_b.y + high_b.height == chart.bottom
    # The axis ends at a round number above the tallest bar (40: 4 ticks of 10).
    assert [tick.label for tick in chart.y_ticks] == ["0", "10", "20", "30", "40"]
    assert chart.rows[1].values == (0, 20)


# -- several records databases ------------------------------------------------------------


@pytest.mark.django_db(databases=SHARD_TEST_ALIASES, transaction=True)
def test_each_records_database_has_its_counts_and_one_has_the_charts() -> None:
    now = database_now("default")
    with routed_by_tenant():
        record_in("shard_a", tenant="tenant-a", created_at=now - timedelta(hours=2))
        for _ in range(2):
            record_in("shard_b", tenant="tenant-b", created_at=now - timedelta(hours=2))
        stuck_in_b = record_in(
            "shard_b",
            tenant="tenant-b",
            key="stuck-b",
            state=State.UNCERTAIN,
            created_at=now - timedelta(hours=3),
            response_status=None,
            response_body=None,
            lease_expires_at=now - timedelta(hours=2),
        )
        client = viewer("view_idempotencyrecord")
        first = client.get(OVERVIEW).content.decode()
        second = client.get(OVERVIEW, {"database": "shard_b"}).content.decode()
        changelist = client.get(CHANGELIST, {"database": "shard_b"}).content.decode()
        refused = client.get(OVERVIEW, {"database": "default"})

    # Both shards' counts on either page, one row each.
    for page in (first, second):
        rows = {
            alias: census_counts(row)
            for alias, row in re.findall(r'<tr data-database="(\w+)">(.*?)</tr>', page, re.S)
        }
        assert rows["shard_a"]["COMPLETED"] == 1 and rows["shard_a"]["UNCERTAIN"] == 0
        assert rows["shard_b"]["COMPLETED"] == 2 and rows["shard_b"]["UNCERTAIN"] == 1
    # The charts and the oldest records are the chosen shard's (the first by default).
    assert "completed 1, failed 0, still unresolved 0" in first
    assert "completed 2, failed 0, still unresolved 1" in second
    assert "stuck-b" not in first
    change = f"{CHANGELIST}{stuck_in_b.pk}/change/?_changelist_filters=database%3Dshard_b"
    assert f'href="{change}">stuck-b</a>' in second
    assert f'href="{OVERVIEW}?database=shard_b" class="idempotency-overview-link"' in changelist
    assert refused.status_code == 400  # not a records database


# The admin overview page's figures and labels.

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
    (tmp_path / "overview_settings.py").write_text(
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
            "DJANGO_SETTINGS_MODULE": "overview_settings",
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
