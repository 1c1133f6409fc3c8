"""Guarantee 1 with real processes: many simultaneous deliveries of one key run once.

gunicorn with 4 worker processes serves the test app on a fresh PostgreSQL
database. Each round, 50 threads, each with its own ``requests.Session``
and so its own TCP connection, are released together by a barrier and POST
the same body with the same ``Idempotency-Key``. The claim is arbitrated by
PostgreSQL alone (``INSERT ... ON CONFLICT DO NOTHING``): the processes share
nothing else.

Per round: exactly one Charge row; no 5xx; every answer is the original 201,
a replay of it (same body bytes, Content-Type and Location, plus
``Idempotent-Replayed: true``), or a 409 ``idempotency_request_in_progress``
with ``Retry-After``; and a retry after the storm gets the replay.

Run with ``pytest tests/live -v -s`` to see a summary line per round.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.live.hooks import slow_note
from tests.live.server import Call, Lazy, LiveServer, Result, fire_together, post

pytestmark = [pytest.mark.postgres, pytest.mark.live, pytest.mark.guarantees]

THREADS = 50
API_VIEW_ROUNDS = 20
CLASS_VIEW_ROUNDS = 4
#: Seconds the view holds its claim (``api-view`` only), widening the race window.
SLEEP = 0.2
IN_PROGRESS = "idempotency_request_in_progress"

TOTALS: dict[str, Counter[str]] = defaultdict(Counter)


@dataclass
class Round:
    """What one storm produced, classified."""

    label: str
    number: int
    key: str
    note: str
    results: list[Result]
    executions: int
    elapsed: float
    first: list[Result] = field(default_factory=list)
    replayed: list[Result] = field(default_factory=list)
    conflicts: list[Result] = field(default_factory=list)
    server_errors: list[Result] = field(default_factory=list)
    other: list[Result] = field(default_factory=list)
    exceptions: list[Result] = field(default_factory=list)

    def __post_init__(self) -> None:
        for result in self.results:
            if result.error is not None:
                self.exceptions.append(result)
            elif result.status is not None and result.status >= 500:
                self.server_errors.append(result)
            elif result.status == 201 and "Idempotent-Replayed" not in result.headers:
                self.first.append(result)
            elif result.status == 201:
                self.replayed.append(result)
            elif result.status == 409:
                self.conflicts.append(result)
            else:
                self.other.append(result)

    def line(self) -> str:
        extra = ""
        if self.other or self.exceptions:
            extra = f" other={len(self.other)} exceptions={len(self.exceptions)}"
        return (
            f"[{self.label}] round {self.number:2d}: executions={self.executions} "
            f"201-first={len(self.first)} 201-replayed={len(self.replayed)} "
            f"409={len(self.conflicts)} 5xx={len(self.server_errors)}{extra} "
            f"elapsed={self.elapsed:.2f}s"
        )

    def tally(self) -> None:
        totals = TOTALS[self.label]
        totals["rounds"] += 1
        totals["requests"] += len(self.results)
        totals["executions"] += self.executions
        totals["201-first"] += len(self.first)
        totals["201-replayed"] += len(self.replayed)
        totals["409"] += len(self.conflicts)
        totals["5xx"] += len(self.server_errors)
        totals["other"] += len(self.other)
        totals["exceptions"] += len(self.exceptions)
        totals["elapsed_ms"] += round(self.elapsed * 1000)


def totals_line(label: str) -> str:
    t = TOTALS[label]
    return (
        f"[{label}] TOTAL: rounds={t['rounds']} requests={t['requests']} "
        f"executions={t['executions']} 201-first={t['201-first']} "
        f"201-replayed={t['201-replayed']} 409={t['409']} 5xx={t['5xx']} "
        f"other={t['other']} exceptions={t['exceptions']} "
        f"storm-time={t['elapsed_ms'] / 1000:.2f}s"
    )


@pytest.fixture(scope="module", autouse=True)
def print_totals() -> Iterator[None]:
    yield
    if TOTALS:
        print("\n" + "\n".join(totals_line(label) for label in TOTALS))


def explainer(server: LiveServer, storm: Round, log_offset: int) -> Callable[[str], str]:
    """Builds assertion messages: the round, the odd responses, records, the server log."""

    def explain(what: str) -> str:
        parts = [what, storm.line(), f"key={storm.key!r} note={storm.note!r}"]
        for name, group in (
            ("exceptions", storm.exceptions),
            ("5xx", storm.server_errors),
            ("other statuses", storm.other),
            ("201 without Idempotent-Replayed", storm.first),
            ("replayed 201 (first 3)", storm.replayed[:3]),
            ("409 (first 3)", storm.conflicts[:3]),
        ):
            if group:
                parts.append(f"{name}:")
                parts.extend(f"  {result.describe()}" for result in group[:10])
        try:
            parts.append(f"records: {server.database.records(storm.key)}")
            parts.append(f"charge ids for the note: {server.database.charge_ids(storm.note)}")
        except Exception as exc:
            parts.append(f"(could not query the live database: {exc})")
        problems = server.problems_since(log_offset)
        if problems:
            parts.append("suspicious server log lines this round:")
            parts.extend(f"  {line}" for line in problems[:30])
        parts.append(server.diagnostics())
        return "\n".join(parts)

    return explain


def storm_round(
    server: LiveServer,
    label: str,
    path: str,
    number: int,
    make_body: Callable[[str], Any],
    note_suffix: str = "",
) -> Round:
    """One round: THREADS simultaneous POSTs with one new key; assert it ran once.

    ``make_body`` gets the round's unique ``note``, by which the Charge rows
    the round created are counted.
    """
    key = f"{label}-{server.run_id}-{number}-{uuid.uuid4().hex[:8]}"
    note = f"{label}-round-{number}-{server.run_id}{note_suffix}"
    body = make_body(note)
    url = server.url + path
    headers = {"Idempotency-Key": key}
    log_offset = server.log_offset()

    started = time.monotonic()
    results = fire_together([Call(url, body, headers)] * THREADS)
    elapsed = time.monotonic() - started
    storm = Round(
        label=label,
        number=number,
        key=key,
        note=note,
        results=results,
        executions=server.database.count_charges(note),
        elapsed=elapsed,
    )
    print(storm.line())
    storm.tally()
    explain = explainer(server, storm, log_offset)

    assert not storm.exceptions, explain("requests failed without an HTTP answer")
    assert not storm.server_errors, explain("5xx answers")
    assert not storm.other, explain("answers that are neither 201 nor 409")
    assert storm.executions == 1, explain(f"the view ran {storm.executions} times, not once")
    assert len(storm.first) == 1, explain(
        f"{len(storm.first)} answers are 201 without Idempotent-Replayed, not exactly one"
    )
    original = storm.first[0]
    created = json.loads(original.body)
    assert created["id"] == server.database.charge_ids(note)[0], explain(
        "the original 201 does not describe the Charge row that was created"
    )
    assert created["amount"] == 100, explain("the original 201 has the wrong amount")
    assert original.headers.get("Idempotency-Key") == key, explain(
        "the original 201 does not echo the Idempotency-Key"
    )

    for replay in storm.replayed:
        assert replay.headers.get("Idempotent-Replayed") == "true", explain(
            f"bad Idempotent-Replayed value: {replay.describe()}"
        )
        assert replay.body == original.body, explain(
            f"a replay's body differs from the original:\n  {replay.describe()}"
        )
        for name in ("Content-Type", "Location", "Idempotency-Key"):
            assert replay.headers.get(name) == original.headers.get(name), explain(
                f"a replay's {name} differs from the original:\n  {replay.describe()}"
            )

    for conflict in storm.conflicts:
        error = json.loads(conflict.body)
        assert error.get("code") == IN_PROGRESS, explain(
            f"a 409 with the wrong code:\n  {conflict.describe()}"
        )
        retry_after = conflict.headers.get("Retry-After", "")
        assert retry_after.isdigit(), explain(
            f"a 409 without a numeric Retry-After:\n  {conflict.describe()}"
        )

    records = server.database.records(key)
    assert len(records) == 1, explain(f"{len(records)} records for the key, not one")
    record = records[0]
    assert (record["state"], record["response_status"]) == ("COMPLETED", 201), explain(
        "the record is not COMPLETED with 201"
    )
    assert bytes(record["response_body"]) == original.body, explain(
        "the stored body is not the bytes the first client received"
    )

    final = post(url, body, headers)
    assert final.status == 201, explain(f"the final retry got {final.describe()}")
    assert final.replayed, explain(f"the final retry was not a replay: {final.describe()}")
    assert final.body == original.body, explain(
        f"the final retry's body differs from the original: {final.describe()}"
    )
    assert server.database.count_charges(note) == 1, explain("the final retry ran the view")

    problems = server.problems_since(log_offset)
    assert not problems, explain("the server logged errors this round")
    return storm


def test_api_view_same_key_storm(live: Lazy[LiveServer]) -> None:
    """@api_view + @idempotent: 20 rounds of 50 simultaneous same-key POSTs, one run each."""
    server = live.get()
    for number in range(1, API_VIEW_ROUNDS + 1):
        storm_round(
            server,
            "api-view",
            "/api-view/charges",
            number,
            lambda note: {"amount": 100, "sleep": SLEEP, "note": note},
        )
    print(totals_line("api-view"))
    assert TOTALS["api-view"]["executions"] == API_VIEW_ROUNDS


@pytest.mark.parametrize(
    ("label", "path"),
    [("mixin", "/mixin/charges"), ("viewset", "/viewset/charges/")],
    ids=["IdempotentMixin", "ViewSet"],
)
def test_class_based_views_same_key_storm(live: Lazy[LiveServer], label: str, path: str) -> None:
    """IdempotentMixin and a ViewSet's @idempotent create: the same storm.

    Their serializer accepts only ``amount`` and ``note``; the race window is
    widened by a note the live server's test hook sleeps on (``hooks.py``).
    """
    server = live.get()
    for number in range(1, CLASS_VIEW_ROUNDS + 1):
        storm_round(
            server,
            label,
            path,
            number,
            lambda note: {"amount": 100, "note": note},
            note_suffix=f" {slow_note(SLEEP)}",
        )
    print(totals_line(label))
    assert TOTALS[label]["executions"] == CLASS_VIEW_ROUNDS


def test_distinct_keys_are_not_deduplicated(live: Lazy[LiveServer]) -> None:
    """50 simultaneous POSTs with 50 different keys (same body) run 50 times."""
    server = live.get()
    label = "distinct-keys"
    note = f"{label}-{server.run_id}"
    body = {"amount": 100, "sleep": 0.1, "note": note}
    url = f"{server.url}/api-view/charges"
    keys = [f"{label}-{server.run_id}-{i}-{uuid.uuid4().hex[:8]}" for i in range(THREADS)]
    log_offset = server.log_offset()

    started = time.monotonic()
    results = fire_together([Call(url, body, {"Idempotency-Key": key}) for key in keys])
    elapsed = time.monotonic() - started
    storm = Round(
        label=label,
        number=1,
        key=keys[0],
        note=note,
        results=results,
        executions=server.database.count_charges(note),
        elapsed=elapsed,
    )
    print(storm.line())
    storm.tally()
    explain = explainer(server, storm, log_offset)

    assert not storm.exceptions, explain("requests failed without an HTTP answer")
    assert not storm.server_errors, explain("5xx answers")
    assert not storm.other and not storm.conflicts and not storm.replayed, explain(
        "with distinct keys every answer must be a first-execution 201"
    )
    assert storm.executions == THREADS, explain(
        f"{storm.executions} executions for {THREADS} distinct keys"
    )
    assert len(storm.first) == THREADS, explain("not every request got its own 201")
    ids = sorted(json.loads(result.body)["id"] for result in storm.first)
    assert ids == server.database.charge_ids(note), explain(
        "the 201 bodies do not name the 50 Charge rows"
    )
    for key, result in zip(keys, results, strict=True):
        assert result.headers.get("Idempotency-Key") == key, explain(
            f"answer for {key!r} echoes another key: {result.describe()}"
        )
    records = server.database.query(
        "SELECT state, response_status, count(*) FROM django_idempotency_record "
        'WHERE "key" = ANY(%s) GROUP BY state, response_status',
        [keys],
    )
    assert records == [("COMPLETED", 201, THREADS)], explain(f"records for the 50 keys: {records}")
    assert not server.problems_since(log_offset), explain("the server logged errors")
    print(totals_line(label))
