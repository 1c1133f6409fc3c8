"""The admin's overview page: ``overview.py``'s figures as tables and two SVG charts.

The view itself is ``IdempotencyRecordAdmin.overview_view`` (admin.py);
this module turns an ``Overview`` into the template's context.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.http import QueryDict
from django.urls import reverse
from django.utils.formats import number_format
from django.utils.timesince import timesince
from django.utils.translation import gettext as _

from django_idempotency._admin.charts import Chart, Series, bar_chart
from django_idempotency._admin.figures import (
    UNRESOLVED,
    AgeCounts,
    HourlyCounts,
    Overview,
    chart_zone,
)
from django_idempotency._admin.leases import lease_label
from django_idempotency.census import Census
from django_idempotency.models import UNRESOLVED_STATES, IdempotencyRecord

TEMPLATE = "admin/django_idempotency/idempotencyrecord/overview.html"
State = IdempotencyRecord.State
#: The hourly chart's layers, bottom up, with their CSS classes (the template's colours).
HOURLY_SERIES = (
    (State.COMPLETED.value, "completed", "bar-completed"),
    (State.FAILED.value, "failed", "bar-failed"),
    (UNRESOLVED, "still unresolved", "bar-unresolved"),
)
#: An hour's label under the axis every this many hours.
HOUR_LABEL_EVERY = 6


def _grouped(value: int) -> str:
    return number_format(value, force_grouping=True)


def _duration(age: timedelta | None, now: datetime) -> str:
    return "-" if age is None else timesince(now - age, now=now)


def census_row(census: Census, several: bool) -> dict[str, Any]:
    """A database's line of the counts: estimates read "about", a capped backlog "at least"."""
    query = QueryDict(mutable=True)
    if several:
        query["database"] = census.database
    states = []
    for value, label in State.choices:
        query["state"] = value
        shown = _grouped(census.counts[value])
        states.append(
            {
                "value": value,
                "label": label,
                "count": census.counts[value],
                "shown": _("about %(count)s") % {"count": shown}
                if value in census.estimated
                else shown,
                "estimated": value in census.estimated,
                "query": query.urlencode(),
            }
        )
    backlog = _grouped(census.purge_backlog)
    query["state"] = "stuck"
    return {
        "database": census.database,
        "stuck": {
            "count": census.stuck,
            "shown": _grouped(census.stuck),
            "query": query.urlencode(),
        },
        "states": states,
        "unresolved": _grouped(census.unresolved),
        "oldest_unresolved": _duration(census.oldest_unresolved_age, census.taken_at),
        "purge_backlog": _("at least %(count)s") % {"count": backlog}
        if census.purge_backlog_capped
        else backlog,
        "unreconciled_operations": census.unreconciled_operations,
        "taken_at": census.taken_at,
    }


def hourly_chart(hourly: HourlyCounts) -> Chart:
    zone = chart_zone()
    categories = [f"{hour:%Y-%m-%d %H:00} {zone}" for hour in hourly.hours]
    ticks = [f"{hour:%b %d}" if hour.hour == 0 else f"{hour:%H:00}" for hour in hourly.hours]
    totals = ", ".join(
        f"{label} {_grouped(hourly.total(name))}" for name, label, _css in HOURLY_SERIES
    )
    sampled = (
        ""
        if hourly.sample_percent is None
        else " "
        + _("Completed and failed counts are estimated from a %(percent)s%% sample.")
        % {"percent": f"{hourly.sample_percent:.2g}"}
    )
    return bar_chart(
        identifier="idempotency-hourly",
        title=_("Records created per hour, by final state"),
        description=_(
            "Stacked bars, one per hour from %(first)s to %(last)s: %(totals)s.%(sampled)s"
        )
        % {"first": categories[0], "last": categories[-1], "totals": totals, "sampled": sampled},
        categories=categories,
        tick_labels=ticks,
        label_every=HOUR_LABEL_EVERY,
        series=[
            Series(name, _(label), css, hourly.counts[name]) for name, label, css in HOURLY_SERIES
        ],
        x_axis_label=_("hour created (%(zone)s)") % {"zone": zone},
        y_axis_label=_("records"),
    )


def age_chart(ages: AgeCounts) -> Chart:
    listed = ", ".join(
        f"{label} {_grouped(count)}" for label, count in zip(ages.labels, ages.counts, strict=True)
    )
    return bar_chart(
        identifier="idempotency-ages",
        title=_("Ages of unresolved records"),
        description=_("Unresolved records by how long ago they were created: %(listed)s.")
        % {"listed": listed},
        categories=list(ages.labels),
        series=[Series(UNRESOLVED, _("unresolved"), "bar-unresolved", ages.counts)],
        x_axis_label=_("age"),
        y_axis_label=_("records"),
        width=360,
    )


def _oldest_rows(overview: Overview, several: bool) -> list[dict[str, Any]]:
    now = overview.census.taken_at
    suffix = ""
    if several:
        # The record page finds its database in the list's preserved filters.
        preserved = QueryDict(mutable=True)
        preserved["_changelist_filters"] = f"database={overview.database}"
        suffix = "?" + preserved.urlencode()
    rows = []
    for record in overview.oldest:
        rows.append(
            {
                "record": record,
                "url": reverse(
                    "admin:django_idempotency_idempotencyrecord_change", args=[record.pk]
                )
                + suffix,
                "age": timesince(record.created_at, now=now),
                "lease": lease_label(record, now),
            }
        )
    return rows


def overview_context(overview: Overview) -> dict[str, Any]:
    """What ``TEMPLATE`` shows, from ``overview``."""
    several = len(overview.censuses) > 1
    return {
        "title": _("Overview of idempotency records"),
        "database": overview.database,
        "several_databases": several,
        "censuses": [census_row(census, several) for census in overview.censuses],
        "states": State.choices,
        "hourly_chart": hourly_chart(overview.hourly),
        "sample_percent": overview.hourly.sample_percent,
        "age_chart": age_chart(overview.ages),
        "oldest": _oldest_rows(overview, several),
        "unresolved_states": UNRESOLVED_STATES,
        "taken_at": overview.census.taken_at,
    }
