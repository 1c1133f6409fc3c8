"""The admin's resolving actions: each guarded by a permission, each logged.

Every action that can cause harm shows a page first (a form or a warning).
That page carries the fencing token of each record as the operator saw it;
applying the action is a compare-and-set on that token, so a record that
changed meanwhile (resolved, or taken over) is skipped, not overwritten.
Records whose owner still holds a live lease are skipped as well.

What the admin accepts from a URL or a form it did not write itself is
checked here too. The admin's own pages only send back values they showed; anything else was
made by hand. Each such value is checked here before it reaches a query, so
that it is refused (400) or skipped, never turned into a database error (a
500): PostgreSQL refuses NUL in text, the fencing token column is a 64-bit
integer, and Python's ``int()`` reads any Unicode digits ("١٢٣" is 123) and
refuses strings of more than 4,300.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable
from datetime import MAXYEAR, MINYEAR, date, timedelta
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db.models import QuerySet
from django.http import HttpRequest, QueryDict
from django.template.response import TemplateResponse
from django.utils.translation import gettext_lazy as _
from django.utils.translation import ngettext

from django_idempotency import _store as store
from django_idempotency import recovery
from django_idempotency._store.clock import to_the_second
from django_idempotency._store.database_time import database_later
from django_idempotency.conf import idempotency_settings
from django_idempotency.exceptions import StaleOwner
from django_idempotency.models import IdempotencyRecord
from django_idempotency.responses import Verdict

State = IdempotencyRecord.State
TEMPLATE = "admin/django_idempotency/idempotencyrecord/action_form.html"


class ResponseForm(forms.Form):
    status = forms.IntegerField(label=_("HTTP status the client will get"))
    body = forms.CharField(
        label=_("Body (JSON, or plain text)"),
        widget=forms.Textarea(attrs={"rows": 6, "cols": 80}),
        required=False,
    )

    def __init__(self, *args: Any, statuses: tuple[int, int], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["status"].validators.extend(
            [MinValueValidator(statuses[0]), MaxValueValidator(statuses[1])]
        )
        self.fields["status"].help_text = _("From %(low)d to %(high)d.") % {
            "low": statuses[0],
            "high": statuses[1],
        }

    def answer_body(self) -> Any:
        text = self.cleaned_data["body"]
        try:
            return json.loads(text) if text.strip() else {}
        except ValueError:
            return text


class ReleaseForm(forms.Form):
    reexecute = forms.BooleanField(
        label=_("I understand that the client's retry will execute the operation again."),
        required=False,
    )


class ExtendForm(forms.Form):
    hours = forms.IntegerField(
        label=_("Keep recognisable for another (hours)"), min_value=1, max_value=24 * 365
    )


#: At most this many records per action. The action's page carries three
#: form fields per record, and Django refuses a POST of more than
#: DATA_UPLOAD_MAX_NUMBER_FIELDS (1,000 by default); and each record is taken
#: over and settled one by one, within one request.
MAX_RECORDS_PER_ACTION = 300

Action = Callable[[Any, HttpRequest, QuerySet[Any]], TemplateResponse | None]


def _bounded(action: Action) -> Action:
    """Refuse a selection too large for one action (a "select all" over a filter)."""

    @functools.wraps(action)
    def bounded(
        modeladmin: Any, request: HttpRequest, queryset: QuerySet[Any]
    ) -> TemplateResponse | None:
        if queryset.order_by()[: MAX_RECORDS_PER_ACTION + 1].count() > MAX_RECORDS_PER_ACTION:
            modeladmin.message_user(
                request,
                _(
                    "Select at most %(max)d records for one action: narrow the list with its "
                    "filters, or act on it page by page."
                )
                % {"max": MAX_RECORDS_PER_ACTION},
                messages.ERROR,
            )
            return None
        return action(modeladmin, request, queryset)

    return bounded


def _operator(request: HttpRequest) -> str:
    return str(getattr(request.user, "get_username", lambda: "?")())


def _taken(
    request: HttpRequest, queryset: Iterable[IdempotencyRecord], *, from_page: bool = True
) -> list[tuple[IdempotencyRecord, store.Claim]]:
    """Take over each selected record still as the operator saw it.

    ``from_page``: the action's page showed each record's token and state,
    and a record whose fields are missing from the POST is skipped like one
    whose fields were made by hand. Reconcile now has no page: what was just
    read is what the operator saw.
    """
    conf = idempotency_settings
    taken = []
    for record in queryset:
        shown_token = str(record.fencing_token) if not from_page else ""
        shown_state = record.state if not from_page else ""
        seen_token = ascii_integer(request.POST.get(f"token-{record.pk}", shown_token))
        seen_state = record_state(request.POST.get(f"state-{record.pk}", shown_state))
        if seen_token is None or seen_state is None:
            continue  # made by hand: no page of ours sends it; counted as skipped
        record.fencing_token = seen_token
        held = store.take_over_for_operator(
            record,
            seen_state=seen_state,
            operator=_operator(request),
            lease=conf.LEASE,
            using=record._state.db or "",  # where the record lives, read from there
        )
        if held is not None:
            record.state = seen_state
            taken.append((record, held))
    return taken


def _ticked_and_gone(modeladmin: Any, request: HttpRequest) -> tuple[int, int]:
    """How many records were ticked, and how many of them no longer exist."""
    if request.POST.get("select_across") == "1":
        return 0, 0  # "select all": the selection is the filter's rows, whatever they are now
    # response_action has refused any id that is not ASCII digits.
    ticked = {int(pk) for pk in request.POST.getlist(ACTION_CHECKBOX_NAME)}
    # The whole table, not the list's filter: a record that left the filter
    # (settled since) still exists.
    found = modeladmin.get_queryset(request).filter(pk__in=ticked).count()
    return len(ticked), len(ticked) - found


def _gone_message(count: int) -> str:
    return ngettext(
        "%(count)d selected record no longer exists: it was released or purged since the "
        "list was shown.",
        "%(count)d selected records no longer exist: they were released or purged since the "
        "list was shown.",
        count,
    ) % {"count": count}


def _page(
    modeladmin: Any,
    request: HttpRequest,
    queryset: QuerySet[IdempotencyRecord],
    *,
    action: str,
    title: str,
    form: forms.Form,
    warning: str = "",
) -> TemplateResponse:
    ticked, gone = _ticked_and_gone(modeladmin, request)
    records = list(queryset)
    context = {
        **modeladmin.admin_site.each_context(request),
        "title": title,
        "action": action,
        # Without records the page offers no Apply: there is nothing to apply to.
        "records": records,
        "gone": _gone_message(gone) if gone else "",
        "none_can": not records and (gone == 0 or gone < ticked),
        "form": form,
        "warning": warning,
        "opts": modeladmin.model._meta,
        "action_checkbox_name": ACTION_CHECKBOX_NAME,
        # Back to the list as it was filtered: its database above all.
        "list_query": request.GET.urlencode(),
    }
    return TemplateResponse(request, TEMPLATE, context)


def _report(
    modeladmin: Any,
    request: HttpRequest,
    done: int,
    selected: int,
    singular: str,
    plural: str,
    *,
    gone: int | None = None,
) -> None:
    modeladmin.message_user(
        request, ngettext(singular, plural, done) % {"count": done}, messages.SUCCESS
    )
    skipped = selected - done
    if skipped:
        modeladmin.message_user(request, _skipped_message(skipped), messages.WARNING)
    _report_gone(modeladmin, request, gone)


def _report_gone(modeladmin: Any, request: HttpRequest, gone: int | None = None) -> None:
    """``gone``: counted before an action that deletes (else counted now)."""
    if gone is None:
        _, gone = _ticked_and_gone(modeladmin, request)
    if gone:
        modeladmin.message_user(request, _gone_message(gone), messages.WARNING)


def _skipped_message(count: int) -> str:
    return ngettext(
        "%(count)d record was skipped: it changed since you looked, or somebody holds its lease.",
        "%(count)d records were skipped: they changed since you looked, or somebody holds "
        "their lease.",
        count,
    ) % {"count": count}


@admin.action(permissions=["reconcile"], description=_("Reconcile now"))
@_bounded
def reconcile_now(modeladmin: Any, request: HttpRequest, queryset: QuerySet[Any]) -> None:
    selected = list(queryset.filter(state__in=store.UNRESOLVED_STATES))
    # Before reconciling: a record its reconciler releases is deleted by this
    # action, not "gone since the list was shown".
    gone = _ticked_and_gone(modeladmin, request)[1]
    settled = released = pending = 0
    for record, held in _taken(request, selected, from_page=False):
        report = recovery.RecoveryReport()
        try:
            recovery.settle(record, held, report)
        except StaleOwner:
            continue
        outcome = next((name for name, count in vars(report).items() if count), "nothing")
        modeladmin.log_change(request, record, f"Reconciled now: {outcome}.")
        if report.completed or report.failed:
            settled += 1
        elif report.released:
            # Release() (or a CLAIMED record, which recovery releases): the
            # record is deleted, and nothing is settled; the retry runs again.
            released += 1
        else:
            pending += 1
    if settled or not released:
        modeladmin.message_user(
            request,
            ngettext(
                "%(count)d record was settled by its reconciler.",
                "%(count)d records were settled by their reconciler.",
                settled,
            )
            % {"count": settled},
            messages.SUCCESS,
        )
    if released:
        modeladmin.message_user(
            request,
            ngettext(
                "%(count)d record was released: the operation did not happen, so the record "
                "is deleted and the client's retry will run it again.",
                "%(count)d records were released: their operations did not happen, so the "
                "records are deleted and the clients' retries will run them again.",
                released,
            )
            % {"count": released},
            messages.SUCCESS,
        )
    if pending:
        modeladmin.message_user(
            request,
            ngettext(
                "%(count)d record stays unresolved: no reconciler is registered for its "
                "operation, or it asked to retry later.",
                "%(count)d records stay unresolved: no reconciler is registered for their "
                "operation, or it asked to retry later.",
                pending,
            )
            % {"count": pending},
            messages.WARNING,
        )
    skipped = len(selected) - settled - released - pending
    if skipped:
        modeladmin.message_user(request, _skipped_message(skipped), messages.WARNING)
    _report_gone(modeladmin, request, gone)


def _resolve_action(
    name: str, outcome: type[recovery.Completed | recovery.Failed], statuses: tuple[int, int]
) -> Callable[..., TemplateResponse | None]:
    label = "completed" if outcome is recovery.Completed else "failed"

    def resolve(
        modeladmin: Any, request: HttpRequest, queryset: QuerySet[Any]
    ) -> TemplateResponse | None:
        unresolved = queryset.filter(state__in=store.UNRESOLVED_STATES)
        form = ResponseForm(request.POST if "apply" in request.POST else None, statuses=statuses)
        if not form.is_valid():
            return _page(
                modeladmin,
                request,
                unresolved,
                action=name,
                title=str(_("Mark records %(label)s") % {"label": label}),
                form=form,
                warning=str(
                    _(
                        "Retries of these requests will get exactly this response, instead of "
                        "running the operation."
                    )
                ),
            )
        done, selected = 0, queryset.count()
        answer = outcome(status=form.cleaned_data["status"], body=form.answer_body())
        for record, held in _taken(request, unresolved):
            try:
                store.complete(
                    held,
                    Verdict.COMPLETED if outcome is recovery.Completed else Verdict.FAILED,
                    answer.stored_response(),
                    ttl=idempotency_settings.TTL,
                )
            except StaleOwner:
                continue
            modeladmin.log_change(request, record, f"Marked {label} with status {answer.status}.")
            done += 1
        _report(
            modeladmin,
            request,
            done,
            selected,
            f"%(count)d record was marked {label}.",
            f"%(count)d records were marked {label}.",
        )
        return None

    resolve.__name__ = name
    return resolve


mark_failed = admin.action(permissions=["mark_failed"], description=_("Mark failed…"))(
    _bounded(_resolve_action("mark_failed", recovery.Failed, (400, 599)))
)
mark_completed = admin.action(permissions=["mark_completed"], description=_("Mark completed…"))(
    _bounded(_resolve_action("mark_completed", recovery.Completed, (200, 399)))
)


@admin.action(permissions=["release"], description=_("Release…"))
@_bounded
def release(
    modeladmin: Any, request: HttpRequest, queryset: QuerySet[Any]
) -> TemplateResponse | None:
    risky = queryset.exclude(state=State.CLAIMED).exists()
    form = ReleaseForm(request.POST if "apply" in request.POST else None)
    confirmed = form.is_valid() and (form.cleaned_data["reexecute"] or not risky)
    if form.is_bound and form.is_valid() and not confirmed:
        # Applied without the tick: say so, or the same page comes back
        # looking as if nothing had been pressed.
        form.add_error(
            "reexecute",
            _("Tick this box to release records past their claim: nothing was released."),
        )
    if not confirmed:
        warning = (
            _(
                "Some of these records are past their claim: an external call may have "
                "happened, or the outcome was stored. Releasing deletes them, and the "
                "client's retry will EXECUTE THE OPERATION AGAIN."
            )
            if risky
            else _("These claims will be deleted; the client's retry runs the operation.")
        )
        return _page(
            modeladmin,
            request,
            queryset,
            action="release",
            title=str(_("Release records")),
            form=form,
            warning=str(warning),
        )
    done, selected = 0, queryset.count()
    # Before releasing: the records this deletes are not "gone since the list was shown".
    gone = _ticked_and_gone(modeladmin, request)[1]
    for record, held in _taken(request, queryset):
        if store.release(held, states=tuple(State.values)):
            modeladmin.log_change(request, record, f"Released (was {record.state}).")
            done += 1
    _report(
        modeladmin,
        request,
        done,
        selected,
        "%(count)d record was released.",
        "%(count)d records were released.",
        gone=gone,
    )
    return None


@admin.action(permissions=["extend"], description=_("Extend retention…"))
@_bounded
def extend_retention(
    modeladmin: Any, request: HttpRequest, queryset: QuerySet[Any]
) -> TemplateResponse | None:
    default_hours = int(idempotency_settings.TTL.total_seconds() // 3600) or 1
    form = ExtendForm(
        request.POST if "apply" in request.POST else None, initial={"hours": default_hours}
    )
    if not form.is_valid():
        return _page(
            modeladmin,
            request,
            queryset,
            action="extend_retention",
            title=str(_("Extend retention")),
            form=form,
        )
    until = database_later(queryset.db, timedelta(hours=form.cleaned_data["hours"]))
    shorter = [record for record in queryset if record.expires_at < until]
    extended = store.extend_retention(
        [record.pk for record in shorter], until=until, using=queryset.db
    )
    # In the site's time zone, named: under USE_TZ=False ``until`` is not UTC.
    shown = to_the_second(until)
    for record in shorter:
        modeladmin.log_change(request, record, f"Retention extended to {shown}.")
    modeladmin.message_user(
        request,
        ngettext(
            "%(count)d record will be kept until %(until)s.",
            "%(count)d records will be kept until %(until)s.",
            extended,
        )
        % {"count": extended, "until": shown},
        messages.SUCCESS,
    )
    _report_gone(modeladmin, request)
    return None


ACTIONS = [reconcile_now, mark_failed, mark_completed, release, extend_retention]


#: PositiveBigIntegerField's range on every backend: 0 to 2**63 - 1.
MAX_BIGINT = 2**63 - 1
_DATE_PARTS = ("year", "month", "day")


def ascii_integer(text: str, *, maximum: int = MAX_BIGINT) -> int | None:
    """``text`` as an integer from 0 to ``maximum``, if it is spelled in ASCII digits."""
    if not (text.isascii() and text.isdigit()) or len(text) > len(str(maximum)):
        return None
    number = int(text)
    return number if number <= maximum else None


def record_state(text: str) -> str | None:
    return text if text in IdempotencyRecord.State.values else None


def storable(text: str, max_length: int) -> bool:
    """Whether a column of ``max_length`` characters could hold ``text`` on every backend."""
    return "\x00" not in text and len(text) <= max_length


def date_drilldown_allowed(field: str, lookup: str, query: QueryDict) -> bool:
    """Whether ``lookup`` is part of a date the date hierarchy itself links to.

    Its links are a year, a year and month, or a year, month and day, each
    given once. Django turns them into a range from that date to the next
    year, month or day, so the year stays strictly between the first and
    the last one ``datetime`` has (the next one must exist, and a time zone
    shift must not leave the calendar).
    """
    names = [f"{field}__{part}" for part in _DATE_PARTS]
    if lookup not in names:
        return False
    given: list[int] = []
    for name in names:
        values = query.getlist(name)
        if not values:
            break
        number = ascii_integer(values[0], maximum=MAXYEAR) if len(values) == 1 else None
        if number is None:
            return False
        given.append(number)
    if any(name in query for name in names[len(given) :]):
        return False  # a month without its year, a day without its month
    year, month, day = (*given, 1, 1)[:3]
    if not MINYEAR < year < MAXYEAR:
        return False
    try:
        date(year, month, day)
    except ValueError:
        return False
    return True
