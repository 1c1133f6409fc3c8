"""Failover: an asynchronous standby loses acknowledged records, and their retries run again.

The records' guarantee (one execution per key; a retry gets the original
answer) holds only as long as the record outlives the request. A failover
to a standby that had not received the primary's last commits takes those
records away after their clients were answered.

Each test builds, with real processes only:

- a primary PostgreSQL of its own (``OwnPostgres``), its database migrated;
- a hot standby made by ``pg_basebackup`` (``FailoverStandby``), which
  streams WAL through ``LaggingLink`` (``failover_link.py``): a TCP relay
  that hands every chunk on ``LINK_DELAY`` seconds late, in both directions,
  the latency of a link between zones (on loopback the lag would be a
  fraction of a millisecond, and what is lost a matter of luck);
- gunicorn serving the test app (``/api-view/charges``, ``@idempotent``:
  a claim commit, then a Charge row and the completion in one commit),
  with a short lease (``failover_settings.py``).

``CLIENTS`` threads send protected requests, each with a key of its own,
and note every answer and when it arrived. After ``LOAD_SECONDS`` the
primary's zone goes dark: the link is cut (bytes in transit dropped), the
old primary is stopped at once (``pg_ctl stop -m immediate``: it is fenced
and never started again; split brain, an old primary that comes back and
takes writes, is out of scope here), the standby is promoted
(``pg_promote()``), and gunicorn restarts pointing at it. Then, on the new
primary, for every key whose 2xx the client had received: is its record
there, COMPLETED or only CLAIMED, and its Charge? And each such key is sent
again, same key and body: does the retry replay the original answer, or run
the view a second time? Executions are counted from both gunicorns' access
logs (a 2xx not marked ``Idempotent-Replayed``), outside the database, as a
payment provider would count its charges.

- ``test_asynchronous_failover_loses_acknowledged_records_and_they_run_again``:
  no synchronous standby. Some acknowledged records are missing and their
  retries run again (a second execution each); keys whose record survived
  replay their original answer. The standby's replay is also paused during
  the load, so that its replay lag is the whole load while its receive lag
  is only the link's: what it had received all survives the promotion
  (replay lag is no loss; only WAL never received is).
- ``test_synchronous_failover_loses_nothing_acknowledged``:
  ``synchronous_standby_names = 'ANY 1 (failover_standby)'`` and
  ``synchronous_commit = on``. The same load and failover lose nothing a
  client was answered for; every retry replays. Before that, with the link
  at no delay, it measures the median request time with the standby
  asynchronous, with ``synchronous_commit = on`` and ``remote_apply``.

Each prints a table of its figures. No timed assertions: only the medians
are reported. Both together: 37-63 s on 2 cores shared with other test runs.
"""

from __future__ import annotations

import re
import statistics
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pytest
import requests
from psycopg import sql

from tests.fleet.failover_link import LaggingLink
from tests.live.own_postgres import OwnPostgres
from tests.live.replica import PRIMARY_SETTINGS, Standby, require_replication_binaries
from tests.live.server import DEFAULT_APP, LiveDatabase, LiveServer, Project, database_url

pytestmark = [pytest.mark.fleet]

FAILOVER_PROJECT = Project(
    settings="tests.fleet.failover_settings",
    app=DEFAULT_APP,
    ready_path="/api-view/charges",
    ready_statuses=(200,),
)
PATH = "/api-view/charges"
STANDBY_NAME = "failover_standby"
#: One-way latency of the replication link, seconds.
LINK_DELAY = 0.2
WORKERS = 4
CLIENTS = 4
#: Seconds of load before the primary's zone goes dark.
LOAD_SECONDS = 3.0
#: Sequential requests per mode and round for the latency figures.
LATENCY_REQUESTS = 10
LATENCY_ROUNDS = 3
#: One-row INSERT statements per mode and round, committed one by one on the primary.
LATENCY_COMMITS = 30
#: The app's lease (failover_settings.py), and how long a retry of a key
#: whose record survived as CLAIMED keeps trying (409 until it ends).
LEASE = 4.0
RETRY_FOR = LEASE + 20.0
REQUEST_TIMEOUT = 30.0
ACCESS_LINE = re.compile(
    r'"POST /api-view/charges HTTP/[\d.]+" (\d{3}) .* key=(\S+) replayed=(\S+)'
)


class FailoverStandby(Standby):
    """A hot standby whose WAL comes through ``link`` and that names itself ``STANDBY_NAME``."""

    def __init__(self, primary: OwnPostgres, link: LaggingLink) -> None:
        super().__init__(primary)
        self.link = link

    def _make_data_dir(self) -> None:
        super()._make_data_dir()
        # Later lines win: the conninfo pg_basebackup -R wrote, through the link.
        with (self.data_dir / "postgresql.auto.conf").open("a") as conf:
            conf.write(
                f"primary_conninfo = 'host=127.0.0.1 port={self.link.port} user=postgres "
                f"application_name={STANDBY_NAME}'\n"
            )

    def execute(self, statement: str) -> list[tuple[Any, ...]]:
        with self._connect() as connection:
            return connection.execute(statement).fetchall()


@dataclass
class Answer:
    key: str
    body: dict[str, Any]
    status: int | None = None
    replayed: bool = False
    content: bytes = b""
    error: str | None = None
    sent: float = 0.0
    received: float = 0.0

    @property
    def acknowledged(self) -> bool:
        return self.status is not None and 200 <= self.status < 300

    @property
    def elapsed(self) -> float:
        return self.received - self.sent


def send(session: requests.Session, url: str, key: str, body: dict[str, Any]) -> Answer:
    answer = Answer(key, body, sent=time.monotonic())
    try:
        response = session.post(
            url + PATH, json=body, headers={"Idempotency-Key": key}, timeout=REQUEST_TIMEOUT
        )
        answer.status = response.status_code
        answer.replayed = response.headers.get("Idempotent-Replayed") == "true"
        answer.content = response.content
    except requests.RequestException as exc:
        answer.error = f"{type(exc).__name__}: {exc}"
    answer.received = time.monotonic()
    return answer


@dataclass
class Site:
    """The primary, the link, the standby, the database and gunicorn of one test."""

    primary: OwnPostgres
    link: LaggingLink
    standby: FailoverStandby
    database: LiveDatabase
    server: LiveServer
    stack: ExitStack
    #: Access logs of servers already stopped (the one before the failover).
    old_logs: list[str] = field(default_factory=list)

    def on_primary(self, statement: str | sql.Composed, params: Any = ()) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.primary.url(), autocommit=True, connect_timeout=5) as conn:
            cursor = conn.execute(statement, params)
            return cursor.fetchall() if cursor.description is not None else []

    def configure_primary(self, **settings: str) -> None:
        """``ALTER SYSTEM`` on the primary and a reload; returns once a new session sees them."""
        for name, value in settings.items():
            self.on_primary(
                sql.SQL("ALTER SYSTEM SET {} = {}").format(sql.Identifier(name), sql.Literal(value))
            )
        self.on_primary("SELECT pg_reload_conf()")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            shown = {name: self.on_primary(f"SHOW {name}")[0][0] for name in settings}
            if shown == settings:
                time.sleep(0.2)  # the backends already open read the file on their next query
                return
            time.sleep(0.05)
        raise AssertionError(f"the primary did not take {settings}: {shown}")

    def time_commits(self, count: int) -> list[float]:
        """Seconds each of ``count`` one-row INSERT statements took to commit on the primary."""
        with psycopg.connect(self.database.url, autocommit=True, connect_timeout=5) as conn:
            conn.execute("CREATE TABLE IF NOT EXISTS failover_commit_probe (id serial)")
            durations = []
            for _ in range(count):
                started = time.monotonic()
                conn.execute("INSERT INTO failover_commit_probe DEFAULT VALUES")
                durations.append(time.monotonic() - started)
        return durations

    def replication(self) -> dict[str, Any]:
        """The standby's row of pg_stat_replication, and the bytes it has not flushed."""
        with psycopg.connect(self.primary.url(), autocommit=True, connect_timeout=5) as conn:
            cursor = conn.execute(
                "SELECT application_name, state, sync_state, write_lag, flush_lag, replay_lag, "
                "pg_wal_lsn_diff(pg_current_wal_lsn(), sent_lsn) AS unsent_bytes, "
                "pg_wal_lsn_diff(pg_current_wal_lsn(), flush_lsn) AS unflushed_bytes, "
                "pg_wal_lsn_diff(pg_current_wal_lsn(), replay_lsn) AS unreplayed_bytes "
                "FROM pg_stat_replication WHERE application_name = %s",
                [STANDBY_NAME],
            )
            names = [column.name for column in cursor.description or ()]
            rows = cursor.fetchall()
        return dict(zip(names, rows[0], strict=True)) if rows else {}

    def wait_streaming(self, sync_state: str) -> None:
        deadline = time.monotonic() + 30
        row: dict[str, Any] = {}
        while time.monotonic() < deadline:
            row = self.replication()
            if row.get("state") == "streaming" and row.get("sync_state") == sync_state:
                return
            time.sleep(0.1)
        raise AssertionError(
            f"the standby is not streaming as {sync_state}: {row}\n" + self.standby.log_tail()
        )

    def access_executions(self) -> Counter[str]:
        """Per key: 2xx answers not marked replayed, in every gunicorn's access log."""
        executions: Counter[str] = Counter()
        for text in [*self.old_logs, self.server.log_text()]:
            for status, key, replayed in ACCESS_LINE.findall(text):
                if status.startswith("2") and replayed != "true":
                    executions[key] += 1
        return executions


@contextmanager
def failover_site(label: str) -> Iterator[Site]:
    bindir = require_replication_binaries()
    with ExitStack() as stack:
        primary = stack.enter_context(
            OwnPostgres(bindir, label=f"failover-{label}-primary", settings=PRIMARY_SETTINGS)
        )
        name = f"idem_failover_{label}"
        primary.create_database(name)
        database = on_server(primary, name)
        server = LiveServer(
            database,
            workers=WORKERS,
            project=FAILOVER_PROJECT,
            extra_env={"IDEMPOTENCY_TEST_LIVE_PGBOUNCER": ""},
        )
        server.migrate()
        # The standby copies the migrated database; the link has no delay yet.
        link = stack.enter_context(LaggingLink(primary.port, delay=0.0))
        standby = FailoverStandby(primary, link)
        stack.enter_context(standby)
        stack.callback(server.stop)
        server.start()
        site = Site(primary, link, standby, database, server, stack)
        stack.callback(lambda: site.database.close_connection())
        site.wait_streaming("async")
        yield site
        server.cleanup_logs()


def on_server(server: OwnPostgres, name: str) -> LiveDatabase:
    """A ``LiveDatabase`` for database ``name`` that exists already (never dropped by it)."""
    database = LiveDatabase(server.url())
    database.name = name
    database.url = database_url(server.url(), name)
    return database


# -- the failover ---------------------------------------------------------------------------


@dataclass
class Failover:
    answers: list[Answer]
    cut_at: float
    stopped_at: float
    before_cut: dict[str, Any]
    dropped_bytes: int
    promote_seconds: float
    restart_seconds: float


def load_then_fail_over(site: Site, label: str, pause_replay: bool = False) -> Failover:
    """Protected requests, then: cut the link, stop the old primary, promote, restart gunicorn."""
    answers: list[Answer] = []
    lock = threading.Lock()
    stop = threading.Event()

    def client(number: int) -> None:
        with requests.Session() as session:
            sequence = 0
            while not stop.is_set():
                sequence += 1
                key = f"failover-{label}-{number}-{sequence}"
                answer = send(session, site.server.url, key, {"amount": sequence, "note": key})
                with lock:
                    answers.append(answer)

    if pause_replay:
        site.standby.pause_replay()
    threads = [threading.Thread(target=client, args=(n,), daemon=True) for n in range(CLIENTS)]
    for thread in threads:
        thread.start()
    time.sleep(LOAD_SECONDS)

    before_cut = site.replication()
    cut_at = time.monotonic()
    dropped = site.link.cut()
    site.primary.stop("immediate")  # fenced: never started again
    stopped_at = time.monotonic()
    stop.set()
    for thread in threads:
        thread.join(REQUEST_TIMEOUT + 10)
    assert not any(thread.is_alive() for thread in threads), "a client still waits"

    started = time.monotonic()
    promoted = site.standby.execute("SELECT pg_promote(true, 60)")
    assert promoted == [(True,)], promoted
    assert site.standby.execute("SELECT pg_is_in_recovery()") == [(False,)]
    promote_seconds = time.monotonic() - started

    # The app's configuration now names the promoted server (a DNS or
    # settings change and a restart, as a deploy would do it).
    started = time.monotonic()
    site.old_logs.append(site.server.log_text())
    site.server.stop()
    site.server.cleanup_logs()
    site.database = on_server(site.standby, site.database.name)
    site.server = LiveServer(
        site.database,
        workers=WORKERS,
        project=FAILOVER_PROJECT,
        extra_env={"IDEMPOTENCY_TEST_LIVE_PGBOUNCER": ""},
    )
    site.stack.callback(site.server.stop)
    site.server.start()
    restart_seconds = time.monotonic() - started
    return Failover(
        answers, cut_at, stopped_at, before_cut, dropped, promote_seconds, restart_seconds
    )


@dataclass
class Outcome:
    """What became of the acknowledged keys on the new primary, and of their retries."""

    acknowledged: list[Answer]
    completed: list[str] = field(default_factory=list)
    claimed_only: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    charges_missing: list[str] = field(default_factory=list)
    retries: dict[str, Answer] = field(default_factory=dict)
    refused_while_leased: int = 0

    def replayed_original(self, key: str, original: Answer) -> bool:
        retry = self.retries[key]
        return retry.replayed and (retry.status, retry.content) == (
            original.status,
            original.content,
        )


def examine_and_retry(site: Site, failover: Failover) -> Outcome:
    acknowledged = [answer for answer in failover.answers if answer.acknowledged]
    outcome = Outcome(acknowledged)
    for answer in acknowledged:
        states = [record["state"] for record in site.database.records(answer.key)]
        if states == ["COMPLETED"]:
            outcome.completed.append(answer.key)
        elif states:
            outcome.claimed_only.append(answer.key)
        else:
            outcome.missing.append(answer.key)
        if site.database.count_charges(answer.key) == 0:
            outcome.charges_missing.append(answer.key)

    # The clients retry the requests that got no 2xx as well (after the
    # acknowledged ones, which the figures are about).
    unanswered = [answer for answer in failover.answers if not answer.acknowledged]
    deadline = time.monotonic() + RETRY_FOR
    with requests.Session() as session:
        for answer in [*acknowledged, *unanswered]:
            while True:
                retry = send(session, site.server.url, answer.key, answer.body)
                if retry.status != 409 or time.monotonic() > deadline:
                    break
                # Its record survived as CLAIMED: refused until the dead owner's lease ends.
                outcome.refused_while_leased += 1
                time.sleep(0.5)
            outcome.retries[answer.key] = retry
    return outcome


def ran_again(outcome: Outcome, executions: Counter[str]) -> list[str]:
    """Acknowledged keys executed twice."""
    return [answer.key for answer in outcome.acknowledged if executions[answer.key] > 1]


def describe_statuses(answers: list[Answer]) -> str:
    counted = Counter(
        str(answer.status) if answer.error is None else "no answer" for answer in answers
    )
    return ", ".join(f"{status}: {count}" for status, count in sorted(counted.items()))


def median_ms(answers: list[Answer]) -> float:
    return statistics.median(answer.elapsed for answer in answers) * 1000


def print_table(
    capsys: pytest.CaptureFixture[str], title: str, rows: list[tuple[str, Any]]
) -> None:
    width = max(len(name) for name, _ in rows)
    lines = [f"\n{title}", "-" * (width + 14)]
    lines += [f"{name:<{width}}  {value}" for name, value in rows]
    with capsys.disabled():
        print("\n".join(lines))


def failover_rows(site: Site, failover: Failover, outcome: Outcome) -> list[tuple[str, Any]]:
    answers = failover.answers
    acknowledged = outcome.acknowledged
    executions = site.access_executions()
    window_start = failover.cut_at - site.link.delay
    in_window = sum(1 for answer in acknowledged if answer.received > window_start)
    after_cut = sum(1 for answer in acknowledged if answer.received > failover.cut_at)
    lag = failover.before_cut
    lags = " / ".join(str(lag.get(name)) for name in ("write_lag", "flush_lag", "replay_lag"))
    behind = " / ".join(
        str(lag.get(name)) for name in ("unsent_bytes", "unflushed_bytes", "unreplayed_bytes")
    )
    fenced_ms = (failover.stopped_at - failover.cut_at) * 1000
    switch = f"{failover.promote_seconds:.2f} / {failover.restart_seconds:.2f}"
    retries = [outcome.retries[answer.key] for answer in acknowledged]
    replayed = sum(outcome.replayed_original(answer.key, answer) for answer in acknowledged)
    ran = sum(1 for retry in retries if retry.acknowledged and not retry.replayed)
    unanswered = [outcome.retries[answer.key] for answer in answers if not answer.acknowledged]
    twice = sum(1 for count in executions.values() if count > 1)
    return [
        ("link delay, one way (s)", f"{site.link.delay:.2f}"),
        ("requests sent", len(answers)),
        ("2xx received by the clients", len(acknowledged)),
        ("not acknowledged (5xx or no answer, at the failover)", len(answers) - len(acknowledged)),
        ("  answers by status", describe_statuses(answers)),
        ("median request time under load (ms)", f"{median_ms(acknowledged):.0f}"),
        ("before the cut: write_lag / flush_lag / replay_lag", lags),
        ("before the cut: bytes unsent / unflushed / unreplayed", behind),
        ("bytes in transit dropped by the cut", failover.dropped_bytes),
        ("cut to old primary stopped (ms)", f"{fenced_ms:.0f}"),
        ("2xx received in the last link delay before the cut, or after it", in_window),
        ("  of which after the cut", after_cut),
        ("promotion (s) / gunicorn restart on the new primary (s)", switch),
        ("acknowledged: record COMPLETED on the new primary", len(outcome.completed)),
        ("acknowledged: record only CLAIMED (completion lost)", len(outcome.claimed_only)),
        ("acknowledged: record missing", len(outcome.missing)),
        ("acknowledged: business row (Charge) missing", len(outcome.charges_missing)),
        ("retries that replayed the original answer", replayed),
        ("retries that ran the view again (2xx, not replayed)", ran),
        ("retries refused with 409 while a dead owner's lease ran", outcome.refused_while_leased),
        (
            "acknowledged keys executed twice (gunicorn access logs)",
            len(ran_again(outcome, executions)),
        ),
        ("retries of the unacknowledged requests, by answer", describe_statuses(unanswered)),
        ("  of which replayed", sum(retry.replayed for retry in unanswered)),
        ("keys of any request executed more than once", twice),
    ]


# -- the tests ------------------------------------------------------------------------------


def test_asynchronous_failover_loses_acknowledged_records_and_they_run_again(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with failover_site("async") as site:
        site.link.delay = LINK_DELAY
        failover = load_then_fail_over(site, "async", pause_replay=True)
        outcome = examine_and_retry(site, failover)
        executions = site.access_executions()
        print_table(
            capsys,
            "failover to an ASYNCHRONOUS standby (replay paused during the load)",
            failover_rows(site, failover, outcome),
        )
        explain = site.server.diagnostics() + "\n" + site.standby.log_tail()

        assert len(outcome.acknowledged) >= 10, explain
        # The loss: records (and their business rows) whose 2xx the client had.
        lost = outcome.missing + outcome.claimed_only
        assert lost, explain
        assert outcome.charges_missing, explain
        # Their retries run the view a second time: a second execution per key.
        for key in outcome.missing + outcome.claimed_only:
            retry = outcome.retries[key]
            assert retry.acknowledged and not retry.replayed, (key, retry, explain)
            assert executions[key] == 2, (key, executions[key], explain)
        # Keys whose record survived replay the answer the client had.
        originals = {answer.key: answer for answer in outcome.acknowledged}
        for key in outcome.completed:
            assert outcome.replayed_original(key, originals[key]), (key, outcome.retries[key])
            assert executions[key] == 1, (key, executions[key], explain)
        # The requests that got no 2xx at the failover end answered too.
        assert all(retry.acknowledged for retry in outcome.retries.values()), explain
        # Replay lag is no loss: the replay was paused through the whole load,
        # yet what the standby had received (all but the link's last moments)
        # was replayed at promotion.
        assert len(outcome.completed) > len(lost), explain


def test_synchronous_failover_loses_nothing_acknowledged(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with failover_site("sync") as site:
        medians: list[tuple[str, Any]] = []
        modes = [
            ("asynchronous standby", {"synchronous_standby_names": ""}, "async"),
            (
                "synchronous_commit = on (remote flush)",
                {
                    "synchronous_standby_names": f"ANY 1 ({STANDBY_NAME})",
                    "synchronous_commit": "on",
                },
                "quorum",
            ),
            (
                "synchronous_commit = remote_apply",
                {
                    "synchronous_standby_names": f"ANY 1 ({STANDBY_NAME})",
                    "synchronous_commit": "remote_apply",
                },
                "quorum",
            ),
        ]
        # Rounds that alternate the modes, so that the machine's other load
        # falls on each alike.
        timed: dict[str, list[Answer]] = {title: [] for title, _, _ in modes}
        commits: dict[str, list[float]] = {title: [] for title, _, _ in modes}
        with requests.Session() as session:
            for _ in range(5):  # warm the workers' connections
                send(session, site.server.url, f"warm-{time.monotonic_ns()}", {"amount": 1})
            for round_number in range(LATENCY_ROUNDS):
                for title, settings, sync_state in modes:
                    site.configure_primary(**settings)
                    site.wait_streaming(sync_state)
                    commits[title] += site.time_commits(LATENCY_COMMITS)
                    for n in range(LATENCY_REQUESTS):
                        key = f"latency-{sync_state}-{round_number}-{n}-{time.monotonic_ns()}"
                        timed[title].append(
                            send(session, site.server.url, key, {"amount": 1, "note": key})
                        )
        for title, answers in timed.items():
            assert all(answer.status == 201 for answer in answers), answers
            commit_ms = statistics.median(commits[title]) * 1000
            medians += [
                (f"link at no delay, {title}: median commit (ms)", f"{commit_ms:.2f}"),
                (f"link at no delay, {title}: median request (ms)", f"{median_ms(answers):.1f}"),
            ]

        site.configure_primary(synchronous_commit="on")
        site.wait_streaming("quorum")
        site.link.delay = LINK_DELAY
        failover = load_then_fail_over(site, "sync")
        outcome = examine_and_retry(site, failover)
        executions = site.access_executions()
        print_table(
            capsys,
            "failover to a SYNCHRONOUS standby (ANY 1, synchronous_commit = on)",
            [*medians, *failover_rows(site, failover, outcome)],
        )
        explain = site.server.diagnostics() + "\n" + site.standby.log_tail()

        assert len(outcome.acknowledged) >= 5, explain
        assert outcome.missing == outcome.claimed_only == outcome.charges_missing == [], explain
        originals = {answer.key: answer for answer in outcome.acknowledged}
        for key in outcome.completed:
            assert outcome.replayed_original(key, originals[key]), (key, outcome.retries[key])
        assert ran_again(outcome, executions) == [], explain
        # Nor did any request that got no 2xx run twice once its client retried.
        assert max(executions.values()) == 1, explain
        assert all(retry.acknowledged for retry in outcome.retries.values()), explain
