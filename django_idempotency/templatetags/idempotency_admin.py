"""The admin's date hierarchy, built from the date range instead of DISTINCT.

Django's own tag lists the years, months or days that have rows with a
``SELECT DISTINCT date_trunc(...)``, which sorts every row of a large table
on every page load. Here the links come from MIN and MAX of the (indexed)
field: two index lookups. A link may lead to an empty day; the page stays
fast at millions of rows. The range is that of every record the
ModelAdmin's ``dated_records()`` gives (the drill-down lists those too),
whatever other filter is chosen: a link may lead to an empty day.
"""

from __future__ import annotations

import calendar
import datetime
from typing import Any

from django import template
from django.contrib.admin.views.main import ChangeList
from django.db.models import Max, Min
from django.utils import formats
from django.utils.text import capfirst
from django.utils.translation import gettext as _

from django_idempotency._store.clock import wall_clock

__all__ = [
    "idempotency_date_hierarchy",
    "register",
]

register = template.Library()


def _bounds(cl: ChangeList, field: str) -> tuple[datetime.date, datetime.date] | None:
    # Of every record the admin dates (dated_records: the resolved ones),
    # not only the filtered list's: MIN and MAX are then the two ends of
    # their (partial) index. Under a filter the index does not serve (a
    # state, a search) either would walk the index past every row.
    # Another ModelAdmin of the records (a project's own admin site) gets
    # this template too, without dated_records: its list's range, as before.
    dated_records = getattr(cl.model_admin, "dated_records", None)
    records = cl.queryset if dated_records is None else dated_records(cl.root_queryset)
    found = records.aggregate(first=Min(field), last=Max(field))
    if found["first"] is None or found["last"] is None:
        return None
    first, last = (wall_clock(found[k]).date() for k in ("first", "last"))
    return first, last


@register.inclusion_tag("admin/date_hierarchy.html")
def idempotency_date_hierarchy(cl: ChangeList) -> dict[str, Any]:
    field = cl.date_hierarchy
    year, month, day = (cl.params.get(f"{field}__{part}") for part in ("year", "month", "day"))

    def link(filters: dict[str, Any]) -> str:
        return str(cl.get_query_string(filters, [f"{field}__"]))

    if year and month and day:
        chosen = datetime.date(int(year), int(month), int(day))
        return {
            "show": True,
            "back": {
                "link": link({f"{field}__year": year, f"{field}__month": month}),
                "title": capfirst(formats.date_format(chosen, "YEAR_MONTH_FORMAT")),
            },
            "choices": [{"title": capfirst(formats.date_format(chosen, "MONTH_DAY_FORMAT"))}],
        }
    bounds = _bounds(cl, field)
    if bounds is None:
        return {"show": False}
    first, last = bounds
    if not year and first.year == last.year:
        year = str(first.year)
        if first.month == last.month:
            month = str(first.month)
    if year and month:
        y, m = int(year), int(month)
        days = [datetime.date(y, m, d) for d in range(1, calendar.monthrange(y, m)[1] + 1)]
        return {
            "show": True,
            "back": {"link": link({f"{field}__year": year}), "title": year},
            "choices": [
                {
                    "link": link(
                        {f"{field}__year": year, f"{field}__month": month, f"{field}__day": d.day}
                    ),
                    "title": capfirst(formats.date_format(d, "MONTH_DAY_FORMAT")),
                }
                for d in days
                if first <= d <= last
            ],
        }
    if year:
        y = int(year)
        months = [datetime.date(y, m, 1) for m in range(1, 13)]
        return {
            "show": True,
            "back": {"link": link({}), "title": _("All dates")},
            "choices": [
                {
                    "link": link({f"{field}__year": year, f"{field}__month": m.month}),
                    "title": capfirst(formats.date_format(m, "YEAR_MONTH_FORMAT")),
                }
                for m in months
                if (first.year, first.month) <= (y, m.month) <= (last.year, last.month)
            ],
        }
    return {
        "show": True,
        "choices": [
            {"link": link({f"{field}__year": y}), "title": str(y)}
            for y in range(first.year, last.year + 1)
        ],
    }
