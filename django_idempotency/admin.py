"""The admin: a log of idempotency records, with safe ways to resolve stuck ones.

Nothing can be added or edited; every field is read-only. Operators act
through the actions in ``admin_actions.py``, each behind its own permission
and each leaving a LogEntry.
"""

from __future__ import annotations

import contextlib
import json
from contextvars import ContextVar
from datetime import datetime, timedelta
from typing import Any, cast

from django.contrib import admin
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.admin.models import LogEntry
from django.core.exceptions import BadRequest, PermissionDenied
from django.core.paginator import Paginator
from django.db import connections
from django.db.models import BooleanField, CharField, Q, QuerySet
from django.db.models.expressions import RawSQL
from django.http import HttpRequest, QueryDict
from django.template.response import TemplateResponse
from django.urls import URLPattern, path
from django.utils.formats import number_format
from django.utils.functional import cached_property
from django.utils.html import format_html, format_html_join
from django.utils.timesince import timesince
from django.utils.translation import gettext_lazy as _

from django_idempotency._admin import actions as admin_actions
from django_idempotency._admin import overview as admin_overview
from django_idempotency._admin.actions import (
    ascii_integer,
    date_drilldown_allowed,
    record_state,
    storable,
)
from django_idempotency._admin.figures import overview_of
from django_idempotency._admin.leases import lease_label
from django_idempotency._store import sealing
from django_idempotency._store.clock import to_the_second
from django_idempotency._store.database_time import (
    DatabaseLater,
    DatabaseNow,
    database_now,
    with_read_time,
)
from django_idempotency._store.routing import record_databases
from django_idempotency._store.steps import steps_of
from django_idempotency.census import planner_estimate, stuck, too_large_to_count_resolved
from django_idempotency.models import (
    OPERATION_MAX_LENGTH,
    RESOLVED_STATES,
    IdempotencyRecord,
    IdempotencyStep,
)

__all__ = [
    "COUNT_CAP",
    "FILTERS",
    "DatabaseFilter",
    "EstimatedCountPaginator",
    "ExpiryFilter",
    "IdempotencyRecordAdmin",
    "ListFilter",
    "OperationFilter",
    "StateFilter",
    "capped_count",
    "records_database_of",
    "stuck",
]

State = IdempotencyRecord.State
_may_decrypt: ContextVar[bool] = ContextVar("django_idempotency_may_decrypt", default=False)
#: Counts above this are not worth an exact COUNT(*) on a large table.
COUNT_CAP = 10_000


def _indented_json(raw: bytes) -> str:
    """A stored JSON body, indented for the change page; ValueError if it is no JSON.

    Non-ASCII text is shown as it is, but for a lone surrogate (a plain
    view's ``JsonResponse`` writes a client's ``"\\ud800"`` escaped, and it
    parses into one), which the page could not be encoded with: that body
    is shown with every non-ASCII character escaped.
    """
    value = json.loads(raw)
    text = json.dumps(value, indent=2, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(value, indent=2)
    return text


def capped_count(queryset: QuerySet[Any]) -> tuple[int, bool]:
    """(count, whether it reached the cap), counting at most COUNT_CAP + 1 rows."""
    count = queryset.order_by()[: COUNT_CAP + 1].count()
    return min(count, COUNT_CAP), count > COUNT_CAP


class EstimatedCountPaginator(Paginator):  # type: ignore[type-arg]
    """Counts exactly up to COUNT_CAP, then uses the planner's estimate.

    An exact COUNT(*) over millions of rows on every page load is what makes
    large admin changelists slow; beyond the cap nobody pages to the end.
    """

    @cached_property
    def count(self) -> int:
        queryset = cast("QuerySet[Any]", self.object_list)
        exact, capped = capped_count(queryset)
        if not capped:
            return exact
        connection = connections[queryset.db]
        if connection.vendor != "postgresql":
            return exact
        sql, params = queryset.order_by().query.sql_with_params()
        with connection.cursor() as cursor:
            cursor.execute(f"EXPLAIN (FORMAT JSON) {sql}", params)
            plan = cursor.fetchone()[0]
        plan = json.loads(plan) if isinstance(plan, str) else plan
        return max(exact, int(plan[0]["Plan"]["Plan Rows"]))


class ListFilter(admin.SimpleListFilter):
    """A list filter that says which values of its parameter it accepts."""

    @classmethod
    def accepts(cls, value: str) -> bool:
        raise NotImplementedError


def _history_tag(alias: str | None) -> str:
    return f"[{alias}] "


def records_database_of(request: HttpRequest) -> str:
    """The records database the operator is looking at: ``?database=``, else the first.

    Record ids repeat from one database to the next, so every admin page
    names its database: the list in its ``database`` parameter, the record
    and action pages in the list's filters they preserve
    (``_changelist_filters``, or the changelist URL the action posts to).
    """
    chosen = request.GET.get(DatabaseFilter.parameter_name)
    if chosen is None:
        preserved = QueryDict(request.GET.get("_changelist_filters", ""))
        chosen = preserved.get(DatabaseFilter.parameter_name)
    every = record_databases()
    if chosen is None:
        return every[0]
    if chosen not in every:
        raise BadRequest("No such records database.")
    return chosen


class DatabaseFilter(ListFilter):
    """Which records database to list; shown only when there is more than one."""

    title = _("database")
    parameter_name = "database"

    @classmethod
    def accepts(cls, value: str) -> bool:
        return value in record_databases()

    def lookups(self, request: HttpRequest, model_admin: Any) -> Any:
        every = record_databases()
        # No choice to offer with one database: the filter is then not shown.
        return [(alias, alias) for alias in every] if len(every) > 1 else []

    def choices(self, changelist: Any) -> Any:
        # No "All": one list shows one database (ids repeat across them).
        current = self.value() or record_databases()[0]
        for value, label in self.lookup_choices:
            yield {
                "selected": value == current,
                "query_string": changelist.get_query_string({self.parameter_name: value}),
                "display": label,
            }

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        return queryset  # get_queryset already reads from the chosen database


class StateFilter(ListFilter):
    title = _("state")
    parameter_name = "state"

    @classmethod
    def accepts(cls, value: str) -> bool:
        return value == "stuck" or record_state(value) is not None

    def lookups(self, request: HttpRequest, model_admin: Any) -> Any:
        return [
            *IdempotencyRecord.State.choices,
            ("stuck", _("stuck (uncertain, or its owner's lease expired)")),
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if value == "stuck":
            return queryset.filter(stuck())
        if value in IdempotencyRecord.State.values:
            return queryset.filter(state=value)
        return queryset


class ExpiryFilter(ListFilter):
    title = _("retention")
    parameter_name = "expires"

    @classmethod
    def accepts(cls, value: str) -> bool:
        return value in ("hour", "day", "expired", "tombstone")

    def lookups(self, request: HttpRequest, model_admin: Any) -> Any:
        return [
            ("hour", _("expiring within an hour")),
            ("day", _("expiring within a day")),
            ("expired", _("expired (awaiting purge)")),
            ("tombstone", _("expired key (tombstone: response purged, retries refused)")),
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if value in ("hour", "day"):
            window = timedelta(hours=1) if value == "hour" else timedelta(days=1)
            return with_retention(queryset).filter(
                expires_at__gt=DatabaseNow(), expires_at__lte=DatabaseLater(window)
            )
        if value == "expired":
            return with_retention(queryset).filter(expires_at__lte=DatabaseNow())
        if value == "tombstone":  # tombstones are resolved: listed along the same index
            return with_retention(queryset).filter(tombstone=True)
        return queryset


def with_retention(records: QuerySet[Any]) -> QuerySet[Any]:
    """The resolved ones among ``records``: what the retention filters and dates are about.

    Only a resolved record is replayed until ``expires_at`` and purged past
    it; an unresolved one never expires (its state filters find it). The
    condition is the expiry index's own (``idempotency_resolved_expiry``,
    partial): said in the query, it lets the planner walk that index.
    """
    return records.filter(state__in=RESOLVED_STATES)


def _estimated_count(estimate: int) -> str:
    """The planner's estimate of a state's records, shown as the counts are: capped."""
    if estimate >= COUNT_CAP:
        return number_format(COUNT_CAP, force_grouping=True) + "+"
    return "~" + number_format(estimate, force_grouping=True)


def _with_a_step(provider_operation_id: str, vendor: str) -> Q:
    """The records with a step of this provider operation id, as one arm of the search's OR.

    PostgreSQL answers an OR of conditions with one index scan per arm
    (BitmapOr) only if every arm can be one. ``id IN (subquery)`` cannot
    (a hashed SubPlan, checked row by row: the search read the whole table,
    0.56 s at 1,000,000 records); ``id = ANY(ARRAY(subquery))`` can: the
    subquery runs once, on the steps' partial index, and its ids are looked
    up by primary key.
    """
    with_step = IdempotencyStep.objects.filter(provider_operation_id=provider_operation_id)
    if vendor != "postgresql":
        return Q(pk__in=with_step.values("record_id"))
    step, record = IdempotencyStep._meta, IdempotencyRecord._meta
    table, record_id, provider_id = (
        step.db_table,
        step.get_field("record").column,
        step.get_field("provider_operation_id").column,
    )
    return Q(
        RawSQL(
            f'"{record.db_table}"."{record.pk.column}" = ANY(ARRAY('
            f'SELECT "{record_id}" FROM "{table}" WHERE "{provider_id}" = %s))',
            [provider_operation_id],
            output_field=BooleanField(),
        )
    )


def _by_date(request: HttpRequest) -> bool:
    """Whether the list is drilled down to a date of the hierarchy (``expires_at``)."""
    return any(name.startswith("expires_at__") for name in request.GET)


class OperationFilter(ListFilter):
    title = _("operation")
    parameter_name = "operation"

    @classmethod
    def accepts(cls, value: str) -> bool:
        # Any operation, not only those listed: the docs show how to ask
        # for an older one in the URL.
        return storable(value, OPERATION_MAX_LENGTH)

    def lookups(self, request: HttpRequest, model_admin: Any) -> Any:
        # Only among the newest records: a DISTINCT over millions of rows on
        # every page load would cost more than the whole page.
        recent = (
            model_admin.get_queryset(request).order_by("-pk").values_list("operation", flat=True)
        )
        return [(name, name) for name in sorted(set(recent[:2000]))]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        return queryset.filter(operation=self.value()) if self.value() else queryset


FILTERS: tuple[type[ListFilter], ...] = (
    DatabaseFilter,
    StateFilter,
    OperationFilter,
    ExpiryFilter,
)


@admin.register(IdempotencyRecord)
class IdempotencyRecordAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = [
        "key",
        "tenant",
        "operation",
        "state",
        "age",
        "lease_status",
        "response_status",
    ]
    list_filter = list(FILTERS)
    # Exact, case-sensitive matches (see get_search_results): operators paste
    # ids, and "contains" would scan the table.
    search_fields = ["key", "tenant", "provider_key", "provider_operation_id"]
    search_help_text = _(
        "Exact key, tenant, provider key or provider operation id (the record's or a step's)."
    )
    date_hierarchy = "expires_at"
    ordering = ["-pk"]
    paginator = EstimatedCountPaginator
    show_full_result_count = False
    # Facet counts are a COUNT per filter choice over the whole table.
    show_facets = admin.ShowFacets.NEVER
    list_per_page = 50
    actions = admin_actions.ACTIONS
    change_list_template = "admin/django_idempotency/idempotencyrecord/change_list.html"
    fieldsets = [
        (None, {"fields": ["tenant", "operation", "key", "state", "fingerprint"]}),
        (_("External call"), {"fields": ["provider_key", "provider_operation_id", "steps"]}),
        (_("Timeline"), {"fields": ["timeline"]}),
        (_("Stored response"), {"fields": ["response_status", "headers", "body"]}),
    ]
    readonly_fields = [
        "tenant",
        "operation",
        "key",
        "state",
        "fingerprint",
        "provider_key",
        "provider_operation_id",
        "steps",
        "timeline",
        "response_status",
        "headers",
        "body",
    ]

    # Record ids repeat from one records database to the next, and a LogEntry
    # names its object by id alone: with several databases each entry says
    # which one it is about, and a record's history shows only its own.
    def log_change(self, request: HttpRequest, obj: Any, message: Any) -> Any:
        if len(record_databases()) > 1:
            message = f"{_history_tag(obj._state.db)}{message}"
        return super().log_change(request, obj, message)

    def get_paginator(
        self,
        request: HttpRequest,
        queryset: Any,
        per_page: int,
        orphans: int = 0,
        allow_empty_first_page: bool = True,
    ) -> Any:
        if queryset.model is LogEntry and len(record_databases()) > 1:
            tag = _history_tag(records_database_of(request))
            queryset = queryset.filter(change_message__startswith=tag)
        return super().get_paginator(request, queryset, per_page, orphans, allow_empty_first_page)

    # A log, not an editor.
    # Each record comes with the database's time, which its lease is shown against.
    def get_queryset(self, request: HttpRequest) -> QuerySet[IdempotencyRecord]:
        records = super().get_queryset(request).using(records_database_of(request))
        if _by_date(request):
            records = with_retention(records)
        return cast(QuerySet[IdempotencyRecord], with_read_time(records))

    def dated_records(self, records: QuerySet[Any]) -> QuerySet[Any]:
        """The records whose dates the date hierarchy links (its first and last expiry)."""
        return with_retention(records)

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Any], search_term: str
    ) -> tuple[QuerySet[Any], bool]:
        term = search_term.strip()
        if not term:
            return queryset, False
        exact = Q(pk__in=[])
        for name in self.search_fields:
            # A column that cannot hold the term is not worth a lookup. NUL
            # never gets here (Django's search form refuses it with a
            # message); it would be a DataError on PostgreSQL.
            column = cast("CharField[Any, Any]", IdempotencyRecord._meta.get_field(name))
            if storable(term, column.max_length or 0):
                exact |= Q(**{name: term})
        # A step's provider id (begin_external(step=...)): a subquery on its
        # partial index, inside the same statement.
        step_column = IdempotencyStep._meta.get_field("provider_operation_id")
        if storable(term, step_column.max_length or 0):
            exact |= _with_a_step(term, connections[queryset.db].vendor)
        return queryset.filter(exact), False

    def lookup_allowed(self, lookup: str, value: str, request: HttpRequest | None = None) -> bool:
        # Only the filters and dates the page itself links to. Django's own
        # check lets any lookup on any column through (?fingerprint__regex=:
        # a scan of the whole table for anyone who can view the list); a
        # refused one is answered 400 (DisallowedModelAdminLookup).
        for list_filter in FILTERS:
            if lookup == list_filter.parameter_name:
                return list_filter.accepts(value)
        query = request.GET if request is not None else QueryDict()
        return date_drilldown_allowed(str(self.date_hierarchy), lookup, query)

    def response_action(
        self, request: HttpRequest, queryset: QuerySet[Any], *args: Any, **kwargs: Any
    ) -> Any:
        # The selection reaches pk__in=[...] unchecked: "abc" is a ValueError.
        if any(ascii_integer(pk) is None for pk in request.POST.getlist(ACTION_CHECKBOX_NAME)):
            raise BadRequest("The selection holds something other than record ids.")
        return super().response_action(request, queryset, *args, **kwargs)

    def get_ordering(self, request: HttpRequest) -> Any:
        # Filtering on expiry, walk the expiry index instead of the whole
        # primary key backwards, skipping most of the table.
        if ExpiryFilter.parameter_name in request.GET or _by_date(request):
            return ["expires_at"]
        return self.ordering or []

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def _has(self, request: HttpRequest, codename: str) -> bool:
        return bool(request.user.has_perm(f"django_idempotency.{codename}_idempotencyrecord"))

    def has_reconcile_permission(self, request: HttpRequest) -> bool:
        return self._has(request, "reconcile")

    def has_mark_failed_permission(self, request: HttpRequest) -> bool:
        return self._has(request, "mark_failed")

    def has_mark_completed_permission(self, request: HttpRequest) -> bool:
        return self._has(request, "mark_completed")

    def has_release_permission(self, request: HttpRequest) -> bool:
        return self._has(request, "release")

    def has_extend_permission(self, request: HttpRequest) -> bool:
        return self._has(request, "extend")

    @staticmethod
    def _now(record: IdempotencyRecord) -> datetime:
        """Where get_queryset() could not read it with the page: on a host clock, say."""
        return database_now(record._state.db or "default")

    @admin.display(description=_("age"), ordering="created_at")
    def age(self, record: IdempotencyRecord) -> str:
        return timesince(record.created_at, now=record.read_at or self._now(record))

    @admin.display(description=_("lease"))
    def lease_status(self, record: IdempotencyRecord) -> str:
        if record.state in RESOLVED_STATES or record.lease_expires_at is None:
            return "-"
        return lease_label(record, record.read_at or self._now(record))

    @admin.display(description=_("steps"))
    def steps(self, record: IdempotencyRecord) -> Any:
        """The steps of an operation of several calls, in begin order: one query, on this page."""
        rows = [
            (
                step.name,
                step.provider_key,
                step.provider_operation_id or "-",
                to_the_second(step.begun_at),
                to_the_second(step.updated_at),
            )
            for step in steps_of(record.pk, using=record._state.db or "default")
        ]
        if not rows:
            return "-"
        header = format_html(
            "<tr><th>{}</th><th>{}</th><th>{}</th><th>{}</th><th>{}</th></tr>",
            _("step"),
            _("provider key"),
            _("provider operation id"),
            _("begun"),
            _("updated"),
        )
        return format_html(
            '<table class="idempotency-steps">{}{}</table>',
            header,
            format_html_join(
                "", "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>", rows
            ),
        )

    @admin.display(description=_("timeline"))
    def timeline(self, record: IdempotencyRecord) -> Any:
        def when(moment: Any) -> str:
            return "-" if moment is None else to_the_second(moment)

        rows = [
            (_("created"), when(record.created_at)),
            (_("lease owner"), record.lease_owner or "-"),
            (_("lease expires"), when(record.lease_expires_at)),
            (_("fencing token"), record.fencing_token),
            (_("updated"), when(record.updated_at)),
            (_("expires"), when(record.expires_at)),
        ]
        return format_html(
            "<table>{}</table>",
            format_html_join("", "<tr><th>{}</th><td>{}</td></tr>", rows),
        )

    def _readable_response(
        self, record: IdempotencyRecord
    ) -> tuple[list[list[str]], bytes | None] | str:
        """The stored headers and body, decrypted for those allowed to see them."""
        headers, body = record.response_headers, record.response_body
        if not record.response_sealed:
            return headers, None if body is None else bytes(body)
        if not _may_decrypt.get():
            return str(_("(encrypted: you lack the permission to view it)"))
        try:
            return sealing.unseal(record.response_headers, record.response_body, sealed=True)
        except sealing.UnreadableRecord as exc:
            return str(_("(encrypted: %(reason)s)") % {"reason": exc})

    @admin.display(description=_("headers"))
    def headers(self, record: IdempotencyRecord) -> Any:
        stored = self._readable_response(record)
        if isinstance(stored, str):
            return stored
        if not stored[0]:
            return "-"
        return format_html(
            "<table>{}</table>",
            format_html_join("", "<tr><th>{}</th><td>{}</td></tr>", (tuple(h) for h in stored[0])),
        )

    @admin.display(description=_("body"))
    def body(self, record: IdempotencyRecord) -> Any:
        stored = self._readable_response(record)
        if isinstance(stored, str):
            return stored
        raw = stored[1]
        if raw is None and record.tombstone:
            return _("(purged past retention: a tombstone, refusing retries until it expires)")
        if raw is None:
            return "-" if not record.is_resolved else _("(not stored: too large or streamed)")
        text = raw.decode("utf-8", errors="replace")
        # A body too deep to parse here (RecursionError) is shown as it is.
        with contextlib.suppress(ValueError, RecursionError):
            text = _indented_json(raw)
        return format_html('<pre class="idempotency-body">{}</pre>', text)

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: Any = None
    ) -> Any:
        # The display methods get no request: tell them, for this render only,
        # whether the user may see decrypted responses.
        allowed = self._has(request, "view_decrypted")
        token = _may_decrypt.set(allowed)
        try:
            response = super().change_view(request, object_id, form_url, extra_context)
            if hasattr(response, "render"):
                response.render()
            return response
        finally:
            _may_decrypt.reset(token)

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> TemplateResponse:
        records = self.get_queryset(request)
        # The counts' links stay on the database they count.
        chosen = request.GET.get(DatabaseFilter.parameter_name)
        on = QueryDict(mutable=True)
        if chosen is not None:
            on[DatabaseFilter.parameter_name] = chosen
        counts = []
        too_large = too_large_to_count_resolved(records.db)
        # Stuck first: what needs recovery or an operator is where to start.
        for value, label in [("stuck", _("stuck")), *State.choices]:
            subset = records.filter(stuck()) if value == "stuck" else records.filter(state=value)
            if too_large and value in RESOLVED_STATES:
                shown = _estimated_count(planner_estimate(records.db, value) or 0)
            else:
                count, capped = capped_count(subset)
                shown = number_format(count, force_grouping=True) + ("+" if capped else "")
            on[StateFilter.parameter_name] = value
            counts.append({"value": value, "label": label, "count": shown, "query": on.urlencode()})
        extra_context = {**(extra_context or {}), "state_counts": counts}
        return super().changelist_view(request, extra_context)  # type: ignore[return-value]

    def get_urls(self) -> list[URLPattern]:
        overview = path(
            "overview/",
            self.admin_site.admin_view(self.overview_view),
            name=f"{self.opts.app_label}_{self.opts.model_name}_overview",
        )
        # Before the model's own URLs, whose "<path:object_id>/" would take it.
        return [overview, *super().get_urls()]

    def overview_view(self, request: HttpRequest) -> TemplateResponse:
        """State counts, charts of the last two days and the oldest unresolved records."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        context = {
            **self.admin_site.each_context(request),
            **admin_overview.overview_context(overview_of(records_database_of(request))),
            "opts": self.opts,
        }
        return TemplateResponse(request, admin_overview.TEMPLATE, context)
