"""The admin in a real browser: an operator finds stuck records and resolves them.

The demo project (testproject) runs under gunicorn on a fresh PostgreSQL
database, with the payment provider simulator beside it
(``tests.live.admin_server``); Playwright drives Debian's Chromium
(``tests.live.browser``). Every record is made by real API traffic: alice
and bob pay and refund, one card is declined, and two payments end in
doubt, the way production leaves them: the provider failed (ORD-1004), or
charged the card and hung up (ORD-1005). Both are UNCERTAIN, and stuck once
their (short) lease has run out.

An operator logs in, follows the "Stuck" count, opens a record, marks one
payment failed and reconciles the other (the provider has the charge), sees
each state change in the list, the success message and the LogEntry on the
record's History page; the client's retry then gets the answer the operator
chose, or the reconciler found.

Screenshots go to a temporary directory, so that a test run leaves the
checkout as it was; ``IDEMPOTENCY_SCREENSHOTS_DIR=docs/screenshots``
refreshes the ones docs/admin.md shows.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from payments.demo_data import ADMIN_PASSWORD, ADMIN_USERNAME, DEMO_TOKENS

from tests.live.admin_server import LEASE, AdminSite, admin_live_server
from tests.live.browser import chromium, require_chromium
from tests.live.services import require_postgres

pytestmark = [pytest.mark.postgres, pytest.mark.live]

CHANGELIST = "/admin/django_idempotency/idempotencyrecord/"
SCREENSHOTS_ENV = "IDEMPOTENCY_SCREENSHOTS_DIR"
ALICE, BOB = DEMO_TOKENS["alice"], DEMO_TOKENS["bob"]

#: The payment the operator marks failed (the provider failed, charged
#: nothing), and the one reconciled (charged, then the connection dropped).
FAILED_ORDER = {"order_id": "ORD-1004", "amount": 7450, "currency": "EUR"}
LOST_ORDER = {"order_id": "ORD-1005", "amount": 2500, "currency": "EUR"}
FAILED_KEY, LOST_KEY = "checkout-ORD-1004", "checkout-ORD-1005"
FAILED_ANSWER = {
    "code": "payment_failed",
    "detail": "The payment provider failed and nothing was charged. Start a new checkout.",
}


def screenshot_dir() -> Path:
    default = Path(tempfile.gettempdir()) / "django-idempotency-screenshots"
    directory = Path(os.environ.get(SCREENSHOTS_ENV) or default)
    directory.mkdir(parents=True, exist_ok=True)
    return directory


# -- the demo data ------------------------------------------------------------------------


def call(
    site: AdminSite, status: int, path: str, token: str, key: str, body: Any, **headers: str
) -> Any:
    response = site.api("POST", path, token, key, body, headers=headers)
    assert response.status_code == status, (path, key, response.status_code, response.text)
    return response.json()


def order(order_id: str, amount: int, currency: str = "EUR") -> dict[str, Any]:
    return {"order_id": order_id, "amount": amount, "currency": currency}


def seed(site: AdminSite) -> dict[str, int]:
    """The API traffic that leaves the records; returns record ids by client key."""
    pay = "/v1/payments"
    first = call(site, 201, pay, ALICE, "checkout-ORD-1001", order("ORD-1001", 4200))
    second = call(site, 201, pay, ALICE, "checkout-ORD-1002", order("ORD-1002", 1999))
    call(site, 201, pay, BOB, "checkout-ORD-2001", order("ORD-2001", 880, "GBP"))
    call(site, 201, f"{pay}/{first['id']}/refunds", ALICE, "refund-ORD-1001-1", {"amount": 1000})
    # Definitive failures, stored as FAILED: a refund beyond the payment, a declined card.
    call(site, 400, f"{pay}/{second['id']}/refunds", ALICE, "refund-ORD-1002-1", {"amount": 5000})
    declined = order("ORD-1003", 15000)
    call(site, 402, pay, ALICE, "checkout-ORD-1003", declined, **{"X-Simulate": "decline"})
    # In doubt: the client gets a 502 and the record stays UNCERTAIN.
    call(site, 502, pay, ALICE, FAILED_KEY, FAILED_ORDER, **{"X-Simulate": "fail-before-charge"})
    call(site, 502, pay, ALICE, LOST_KEY, LOST_ORDER, **{"X-Simulate": "charge-then-disconnect"})
    assert [c["metadata"]["order_id"] for c in site.provider.ledger()].count("ORD-1005") == 1

    # Stuck once nobody holds the lease any more.
    deadline = time.monotonic() + LEASE + 10
    while site.database.query(
        "SELECT 1 FROM django_idempotency_record WHERE state IN "
        "('CLAIMED', 'IN_PROGRESS', 'UNCERTAIN') AND lease_expires_at > now()"
    ):
        assert time.monotonic() < deadline, "a lease did not run out"
        time.sleep(0.2)
    rows = site.database.query('SELECT "key", id, state FROM django_idempotency_record')
    states = {key: state for key, _, state in rows}
    assert states[FAILED_KEY] == states[LOST_KEY] == "UNCERTAIN", states
    return {key: int(record_id) for key, record_id, _ in rows}


class AdminDemo:
    """The seeded demo and a Chromium, started by the first test that needs them.

    Starting inside the test lets ``require_chromium()`` and
    ``require_postgres()`` skip it (or fail it, in CI) rather than error its
    setup.
    """

    def __init__(self) -> None:
        self._stack = contextlib.ExitStack()
        self._error: BaseException | None = None
        self.site: AdminSite | None = None
        self.browser: Any = None
        self.records: dict[str, int] = {}

    def get(self) -> AdminDemo:
        require_chromium()
        url = require_postgres()
        if self._error is not None:
            raise RuntimeError("the admin demo failed to start earlier") from self._error
        if self.site is None:
            try:
                site = self._stack.enter_context(admin_live_server(url))
                self.records = seed(site)
                self.browser = self._stack.enter_context(chromium())
                self.site = site
            except BaseException as exc:
                self._error = exc
                raise
        return self

    def close(self) -> None:
        self._stack.close()


@pytest.fixture(scope="module")
def demo() -> Iterator[AdminDemo]:
    lazy = AdminDemo()
    try:
        yield lazy
    finally:
        lazy.close()


@contextlib.contextmanager
def logged_in(admin: AdminDemo) -> Iterator[Any]:
    """A browser tab in a fresh context, logged in as the demo's superuser."""
    assert admin.site is not None
    context = admin.browser.new_context(
        base_url=admin.site.url, viewport={"width": 1360, "height": 760}, locale="en-US"
    )
    # The navigation sidebar closed, as its toggle leaves it: room for the list.
    context.add_init_script("window.localStorage.setItem('django.admin.navSidebarIsOpen', 'false')")
    context.set_default_timeout(10_000)
    tab = context.new_page()
    try:
        tab.goto(f"/admin/login/?next={CHANGELIST}")
        tab.fill("#id_username", ADMIN_USERNAME)
        tab.fill("#id_password", ADMIN_PASSWORD)
        tab.click("input[type=submit]")
        tab.wait_for_url(f"**{CHANGELIST}")
        yield tab
    finally:
        context.close()


# -- reading the admin's pages ------------------------------------------------------------


def shoot(page: Any, name: str, *, full_page: bool = False) -> None:
    page.screenshot(
        path=str(screenshot_dir() / name), full_page=full_page, animations="disabled", caret="hide"
    )


def listed(page: Any) -> dict[str, dict[str, str]]:
    """The changelist's rows: client key -> {column: text}."""
    rows: dict[str, dict[str, str]] = {}
    for row in page.locator("#result_list tbody tr").all():
        cells = {
            name: row.locator(f".field-{name}").inner_text().strip()
            for name in ("key", "tenant", "operation", "state", "lease_status", "response_status")
        }
        rows[cells["key"]] = cells
    return rows


def counts(page: Any) -> dict[str, str]:
    """The counts at the top of the list: state -> the number shown."""
    shown = {}
    for link in page.locator("a.idempotency-count").all():
        shown[str(link.get_attribute("data-state"))] = link.locator("strong").inner_text()
    return shown


def messages(page: Any, level: str = "success") -> list[str]:
    return [text.strip() for text in page.locator(f"ul.messagelist li.{level}").all_inner_texts()]


def field(page: Any, name: str) -> str:
    return str(page.locator(f".form-row.field-{name} .readonly").inner_text())


def run_action(page: Any, record_id: int, action: str) -> None:
    page.locator(f'input.action-select[value="{record_id}"]').check()
    page.select_option('select[name="action"]', action)
    page.click('button[name="index"]')


def history(page: Any) -> list[str]:
    """The History page's rows: "user | action" per LogEntry, oldest first."""
    page.click("a.historylink")
    page.wait_for_url(re.compile(r"/history/"))
    return [
        " | ".join(cell.strip() for cell in row.locator("td, th").all_inner_texts())
        for row in page.locator("#change-history tbody tr").all()
    ]


# -- the tests ----------------------------------------------------------------------------


def test_operator_finds_a_stuck_payment_and_marks_it_failed(demo: AdminDemo) -> None:
    admin = demo.get()
    assert admin.site is not None
    with logged_in(admin) as page:
        database = admin.site.database
        record_id = admin.records[FAILED_KEY]

        # The list: every record, newest first, with the counts on top.
        rows = listed(page)
        assert rows["checkout-ORD-1001"]["state"] == "completed"
        assert rows["checkout-ORD-1001"]["response_status"] == "201"
        assert (
            rows["refund-ORD-1002-1"]["state"],
            rows["refund-ORD-1002-1"]["response_status"],
        ) == (
            "failed",
            "400",
        )
        assert rows["checkout-ORD-1003"]["response_status"] == "402"  # the declined card
        assert (rows[FAILED_KEY]["state"], rows[FAILED_KEY]["lease_status"]) == (
            "uncertain",
            "expired",
        )
        in_database = dict(
            database.query(
                "SELECT state, count(*)::text FROM django_idempotency_record GROUP BY state"
            )
        )
        shown = counts(page)
        for state in ("CLAIMED", "IN_PROGRESS", "UNCERTAIN", "COMPLETED", "FAILED"):
            assert shown[state] == in_database.get(state, "0"), (state, shown, in_database)
        stuck_before = int(shown["stuck"])
        assert stuck_before >= 1
        shoot(page, "admin-changelist.png")

        # The "Stuck" count links to the stuck filter.
        page.click('a.idempotency-count[data-state="stuck"]')
        page.wait_for_url(re.compile(r"\?state=stuck$"))
        stuck = listed(page)
        assert FAILED_KEY in stuck and len(stuck) == stuck_before
        assert {row["lease_status"] for row in stuck.values()} == {"expired"}
        assert "checkout-ORD-1001" not in stuck
        shoot(page, "admin-stuck.png")

        # Open it: who held it until when, and the key the provider was called with.
        page.click(f"#result_list .field-key a:text-is('{FAILED_KEY}')")
        page.wait_for_url(re.compile(rf"{CHANGELIST}{record_id}/change/"))
        assert field(page, "state") == "uncertain"
        [(provider_key,)] = database.query(
            'SELECT provider_key FROM django_idempotency_record WHERE "key" = %s', [FAILED_KEY]
        )
        assert provider_key and field(page, "provider_key") == provider_key
        timeline = field(page, "timeline")
        for label in (
            "created",
            "lease owner",
            "lease expires",
            "fencing token",
            "updated",
            "expires",
        ):
            assert label in timeline
        assert field(page, "body") == "-"  # nothing stored: the outcome is unknown

        # Back to the stuck list. The provider charged nothing: mark it failed.
        page.go_back()
        page.wait_for_url(re.compile(r"\?state=stuck$"))
        run_action(page, record_id, "mark_failed")
        assert page.locator("#content h1").inner_text() == "Mark records failed"
        assert "Retries of these requests will get exactly this response" in page.inner_text(
            ".idempotency-warning"
        )
        page.fill("#id_status", "402")
        page.fill("#id_body", json.dumps(FAILED_ANSWER))
        shoot(page, "admin-mark-failed.png")
        page.click('input[name="_apply"]')

        # Back on the stuck list: the message, and the record is stuck no more.
        page.wait_for_url(re.compile(r"\?state=stuck$"))
        assert messages(page) == ["1 record was marked failed."]
        assert messages(page, "warning") == []
        assert FAILED_KEY not in listed(page)
        assert int(counts(page)["stuck"]) == stuck_before - 1

        # Found by its exact key (in the whole list, not among the stuck): FAILED,
        # with the status the client will get.
        page.goto(CHANGELIST)
        page.fill("#searchbar", FAILED_KEY)
        page.press("#searchbar", "Enter")
        page.wait_for_url(re.compile(r"\?q="))
        found = listed(page)
        assert list(found) == [FAILED_KEY]
        assert (found[FAILED_KEY]["state"], found[FAILED_KEY]["response_status"]) == (
            "failed",
            "402",
        )
        assert found[FAILED_KEY]["lease_status"] == "-"

        # Its page shows the stored answer, pretty-printed, and its headers.
        page.click(f"#result_list .field-key a:text-is('{FAILED_KEY}')")
        page.wait_for_url(re.compile(rf"{CHANGELIST}{record_id}/change/"))
        assert field(page, "state") == "failed"
        body = page.locator(".field-body pre.idempotency-body").inner_text()
        assert json.loads(body) == FAILED_ANSWER
        assert '\n  "code": "payment_failed",\n' in body  # indented, one key a line
        assert "application/json" in field(page, "headers")
        shoot(page, "admin-change.png", full_page=True)

        # The LogEntry: who did what, when.
        entries = history(page)
        assert len(entries) == 1
        assert ADMIN_USERNAME in entries[0] and "Marked failed with status 402." in entries[0]
        shoot(page, "admin-history.png")
        logged = database.query(
            "SELECT change_message FROM django_admin_log WHERE object_id = %s", [str(record_id)]
        )
        assert len(logged) == 1 and "Marked failed with status 402." in logged[0][0]

        # The client's retry now gets exactly that answer, replayed.
        retry = admin.site.api("POST", "/v1/payments", ALICE, FAILED_KEY, FAILED_ORDER)
        assert (retry.status_code, retry.json()) == (402, FAILED_ANSWER)
        assert retry.headers["Idempotent-Replayed"] == "true"


def test_operator_reconciles_a_stuck_payment(demo: AdminDemo) -> None:
    admin = demo.get()
    assert admin.site is not None
    with logged_in(admin) as page:
        record_id = admin.records[LOST_KEY]

        page.click('a.idempotency-count[data-state="stuck"]')
        page.wait_for_url(re.compile(r"\?state=stuck$"))
        stuck_before = int(counts(page)["stuck"])
        assert listed(page)[LOST_KEY]["state"] == "uncertain"

        # No form: the reconciler asks the provider, which has the charge.
        run_action(page, record_id, "reconcile_now")
        page.wait_for_url(re.compile(r"\?state=stuck$"))
        assert messages(page) == ["1 record was settled by its reconciler."]
        assert messages(page, "warning") == []  # nothing was skipped
        assert LOST_KEY not in listed(page)
        assert int(counts(page)["stuck"]) == stuck_before - 1
        shoot(page, "admin-reconciled.png")

        page.goto(f"{CHANGELIST}?q={LOST_KEY}")
        found = listed(page)
        assert (found[LOST_KEY]["state"], found[LOST_KEY]["response_status"]) == (
            "completed",
            "201",
        )

        page.click(f"#result_list .field-key a:text-is('{LOST_KEY}')")
        page.wait_for_url(re.compile(rf"{CHANGELIST}{record_id}/change/"))
        stored = json.loads(page.locator(".field-body pre.idempotency-body").inner_text())
        assert stored["order_id"] == "ORD-1005" and stored["amount"] == 2500
        entries = history(page)
        assert len(entries) == 1 and "Reconciled now: completed." in entries[0]

        # The client's retry gets the payment the reconciler recorded, as a replay;
        # the card was charged once.
        retry = admin.site.api("POST", "/v1/payments", ALICE, LOST_KEY, LOST_ORDER)
        assert retry.status_code == 201 and retry.json() == stored
        assert retry.headers["Idempotent-Replayed"] == "true"
        assert retry.headers["Location"] == f"/v1/payments/{stored['id']}"
        charges = admin.site.provider.charges_by_order()["ORD-1005"]
        [(charge_id,)] = admin.site.database.query(
            "SELECT provider_charge_id FROM payments_payment WHERE id = %s", [stored["id"]]
        )
        assert [charge["id"] for charge in charges] == [charge_id]


# -- the overview page --------------------------------------------------------------------

OVERVIEW = f"{CHANGELIST}overview/"
#: Two days of earlier traffic, a record every few minutes, busier by day; one
#: in sixteen FAILED; and four payments left UNCERTAIN at known ages.
HISTORY = """
INSERT INTO django_idempotency_record (
    tenant, operation, "key", fingerprint, state, lease_owner, lease_expires_at,
    fencing_token, provider_key, provider_operation_id, response_status,
    response_headers, response_body, created_at, updated_at, expires_at
)
SELECT 'history', 'POST v1/payments', 'history-' || i, md5(i::text),
    CASE WHEN i %% 16 = 0 THEN 'FAILED' ELSE 'COMPLETED' END, '', NULL, 1, '', '',
    CASE WHEN i %% 16 = 0 THEN 402 ELSE 201 END, '[]'::jsonb, convert_to('{}', 'UTF8'),
    created, created, created + interval '72 hours'
FROM (
    SELECT i, statement_timestamp() - i * interval '97 seconds'
        - (1 + sin(i / 300.0)) * interval '40 seconds' AS created
    FROM generate_series(1, 1750) AS i
) AS spread
WHERE i %% (2 + (i / 150) %% 3) = 0
UNION ALL
SELECT 'history', 'POST v1/payouts', 'history-stuck-' || minutes, md5(minutes::text),
    'UNCERTAIN', 'web-1:4242', statement_timestamp() - interval '1 minute', 1, 'pk_h', '',
    NULL, '[]'::jsonb, NULL, created, created, created + interval '72 hours'
FROM (
    SELECT minutes, statement_timestamp() - minutes * interval '1 minute' AS created
    FROM unnest(ARRAY[3, 20, 300, 1800]) AS minutes
) AS stuck
RETURNING id
"""


def svg_values(page: Any, chart: str) -> dict[str, int]:
    """The bars' figures (their ``data-value``) of one chart, summed per series."""
    totals: dict[str, int] = {}
    for bar in page.locator(f"#{chart} svg rect[data-series]").all():
        series = str(bar.get_attribute("data-series"))
        totals[series] = totals.get(series, 0) + int(str(bar.get_attribute("data-value")))
    return totals


def table_rows(page: Any, chart: str) -> dict[str, list[int]]:
    """A chart's fallback table (hidden in its <details>): row label -> the figures."""
    rows = {}
    for row in page.locator(f'table[data-chart="{chart}"] tbody tr').all():
        label = str(row.locator("th").text_content()).strip()
        rows[label] = [int(str(cell).strip()) for cell in row.locator("td").all_text_contents()]
    return rows


def test_operator_opens_the_overview_from_the_list(demo: AdminDemo) -> None:
    admin = demo.get()
    assert admin.site is not None
    database = admin.site.database
    database.query(HISTORY)
    with logged_in(admin) as page:
        page.click("a.idempotency-overview-link")
        page.wait_for_url(f"**{OVERVIEW}")
        assert page.locator("#content h1").inner_text() == "Overview of idempotency records"

        # The counts per state are the table's.
        in_database = dict(
            database.query("SELECT state, count(*) FROM django_idempotency_record GROUP BY state")
        )
        shown = {
            str(cell.get_attribute("data-state")): int(str(cell.get_attribute("data-count")))
            for cell in page.locator("#idempotency-census td.census-count").all()
        }
        states = ("CLAIMED", "IN_PROGRESS", "UNCERTAIN", "COMPLETED", "FAILED")
        assert shown == {state: in_database.get(state, 0) for state in states}
        assert page.locator("#idempotency-census td.purge-backlog").inner_text() == "0"

        # Two charts, drawn in the page (no script), each named for screen readers.
        for chart, title in [
            ("idempotency-hourly", "Records created per hour, by final state"),
            ("idempotency-ages", "Ages of unresolved records"),
        ]:
            svg = page.locator(f"#{chart} > svg[role=img]")
            assert svg.is_visible()
            assert svg.locator(":scope > title").text_content() == title
            assert svg.get_attribute("aria-labelledby") == f"{chart}-title {chart}-desc"
        assert page.locator("script[src*='//']").count() == 0  # nothing from elsewhere

        # Every hour the chart shows holds the records created in it, per final state.
        by_hour: dict[str, dict[str, int]] = {}
        for hour, state, count in database.query(
            "SELECT to_char(date_trunc('hour', created_at AT TIME ZONE 'UTC'), "
            "'YYYY-MM-DD HH24:00 \"UTC\"'), CASE WHEN state IN ('COMPLETED', 'FAILED') "
            "THEN state ELSE 'UNRESOLVED' END, count(*) FROM django_idempotency_record "
            "GROUP BY 1, 2"
        ):
            by_hour.setdefault(hour, {})[state] = count
        hours = table_rows(page, "idempotency-hourly")
        assert len(hours) == 48
        for hour, figures in hours.items():
            expected = by_hour.get(hour, {})
            series = ("COMPLETED", "FAILED", "UNRESOLVED")
            assert figures == [expected.get(name, 0) for name in series], hour
        assert sum(sum(figures) for figures in hours.values()) > 600  # the history is in it
        drawn = svg_values(page, "idempotency-hourly")
        assert drawn == {
            name: total
            for name, total in (
                (name, sum(figures[index] for figures in hours.values()))
                for index, name in enumerate(("COMPLETED", "FAILED", "UNRESOLVED"))
            )
            if total
        }

        # The ages: every unresolved record, in its bucket.
        unresolved = sum(in_database.get(state, 0) for state in states[:3])
        assert sum(svg_values(page, "idempotency-ages").values()) == unresolved
        ages = table_rows(page, "idempotency-ages")
        assert ages["< 5 min"][0] >= 1 and ages["< 1 h"][0] >= 1
        assert ages["< 1 day"][0] >= 1 and ages["older"][0] >= 1
        shoot(page, "admin-overview.png", full_page=True)

        # The oldest unresolved record first; its link opens it.
        [(oldest_key, oldest_id)] = database.query(
            'SELECT "key", id FROM django_idempotency_record WHERE state IN '
            "('CLAIMED', 'IN_PROGRESS', 'UNCERTAIN') ORDER BY created_at LIMIT 1"
        )
        assert oldest_key == "history-stuck-1800"
        first = page.locator("#idempotency-oldest tbody tr").first.locator("a")
        assert first.inner_text() == oldest_key
        first.click()
        page.wait_for_url(re.compile(rf"{CHANGELIST}{oldest_id}/change/"))
        assert field(page, "state") == "uncertain"
