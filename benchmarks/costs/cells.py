"""The cells of the cost table: each design, each kind of request, and how it is sent.

A cell is a design (the unprotected view, a hand-written floor, a mode of
the package; benchmarks/benchapp/views.py) and a kind of request:

* a first execution: a new key per request;
* a replay: one key, executed once before the loop;
* a 409: a duplicate while the first request with its key is in flight.
  The first request really is in flight: it runs in a thread of its own and
  waits inside its view, on the business table that a second connection
  holds locked (its claim committed, its business INSERT waiting), until
  the loop is over. Only the designs that claim before the view answer
  such a duplicate 409 at once; see ``Variant.in_flight``.

Requests go through Django's test client in this process, in the same
order, with the same keys (numbered, of one length) in every run, so that
what a loop of them costs repeats from run to run.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg

BODY = b'{"amount": 1250, "currency": "EUR"}'
#: The table every design's business write goes to (one row per execution).
BUSINESS_TABLE = "benchapp_payment"

FIRST = "first execution"
REPLAY = "replay"
CONFLICT = "409"
CASES = (FIRST, REPLAY, CONFLICT)


@dataclass(frozen=True)
class Variant:
    name: str
    path: str
    #: What it is, for the table's legend.
    about: str
    #: Whether requests carry an Idempotency-Key (replays and 409s exist).
    keyed: bool = True
    #: Why a duplicate in flight gets no 409 at once ("" when it does).
    in_flight: str = ""

    @property
    def slug(self) -> str:
        return self.name.replace(" ", "-")


NO_WRITE = Variant(
    "no write",
    "/no-write",
    "the unprotected view without its INSERT: what Django, DRF and the test client cost",
    keyed=False,
)
UNPROTECTED = Variant(
    "unprotected", "/unprotected", "the bare view: one INSERT in autocommit", keyed=False
)
FLOOR = Variant(
    "floor",
    "/floor",
    "hand-written, claim first: the claim commits, then the INSERT and the completing "
    "UPDATE in one transaction; a replay is the claim (a no-op) and a SELECT",
)
FLOOR_LOOKUP_FIRST = Variant(
    "floor lookup-first",
    "/floor-lookup-first",
    "the same, looking the key up before claiming: a replay is one SELECT",
)
_OPTIMISTIC_DUPLICATE = (
    "no 409 at once: a duplicate runs the view too, then waits on the unique index for the "
    "first one's transaction, rolls back and answers from its record (a replay), or 409 "
    "only after waiting `IN_FLIGHT_WAIT`"
)
FLOOR_OPTIMISTIC = Variant(
    "floor optimistic",
    "/floor-optimistic",
    "hand-written, one transaction: a lookup, the INSERT, then INSERT .. ON CONFLICT DO "
    "NOTHING of the finished record",
    in_flight=_OPTIMISTIC_DUPLICATE,
)
PACKAGE_DEFAULT = Variant("package default", "/protected", "`@idempotent`: claim, view, completion")
PACKAGE_OPTIMISTIC = Variant(
    "package optimistic",
    "/protected-optimistic",
    "`@idempotent(optimistic=True)`: lookup, view, the finished record, one commit",
    in_flight=_OPTIMISTIC_DUPLICATE,
)
VARIANTS = (
    NO_WRITE,
    UNPROTECTED,
    FLOOR,
    FLOOR_LOOKUP_FIRST,
    FLOOR_OPTIMISTIC,
    PACKAGE_DEFAULT,
    PACKAGE_OPTIMISTIC,
)


def variants_named(names: list[str]) -> tuple[Variant, ...]:
    """The variants of ``names``, in the table's order."""
    known = {variant.name for variant in VARIANTS}
    unknown = set(names) - known
    if unknown:
        raise ValueError(f"unknown designs {sorted(unknown)}; known: {sorted(known)}")
    return tuple(variant for variant in VARIANTS if variant.name in names)


@dataclass(frozen=True)
class Cell:
    variant: Variant
    case: str

    @property
    def name(self) -> str:
        return f"{self.variant.name}, {self.case}"

    @property
    def status(self) -> int:
        return 409 if self.case == CONFLICT else 201

    @property
    def writes_business_row(self) -> bool:
        return self.case == FIRST and self.variant is not NO_WRITE


def cells(variants: tuple[Variant, ...] = VARIANTS) -> list[Cell]:
    """Every cell that exists: no replay or 409 without a key, no 409 where none is answered."""
    found = []
    for variant in variants:
        for case in CASES:
            if case != FIRST and not variant.keyed:
                continue
            if case == CONFLICT and variant.in_flight:
                continue
            found.append(Cell(variant, case))
    return found


class UnexpectedAnswer(AssertionError):
    pass


class Driver:
    """Sends a cell's requests through Django's test client (Django set up, in this process).

    ``locker_url`` is a direct connection to the benchmark database (not
    through a relay): it holds the business table locked while a 409 loop
    runs.
    """

    def __init__(self, locker_url: str) -> None:
        from django.test import Client

        self.client = Client()
        self.locker_url = locker_url

    def post(self, cell: Cell, key: str | None, status: int, replayed: bool) -> None:
        headers = {} if key is None else {"Idempotency-Key": key}
        response = self.client.post(
            cell.variant.path, BODY, content_type="application/json", headers=headers
        )
        was_replayed = response.headers.get("Idempotent-Replayed") == "true"
        if response.status_code != status or was_replayed != replayed:
            raise UnexpectedAnswer(
                f"{cell.name}: answered {response.status_code} (replayed: {was_replayed}), "
                f"expected {status} (replayed: {replayed}): {response.content[:300]!r}"
            )

    def key(self, cell: Cell, loop: str, index: int) -> str | None:
        """The key of request ``index`` of ``loop``: one length in every loop and run."""
        if not cell.variant.keyed:
            return None
        if cell.case == FIRST:
            return f"first-{cell.variant.slug}-{loop}-{index:07d}"
        if cell.case == REPLAY:
            return f"replay-{cell.variant.slug}"
        return f"in-flight-{cell.variant.slug}-{loop}"

    @contextlib.contextmanager
    def ready(self, cell: Cell, loop: str, first_loop: bool) -> Iterator[None]:
        """What must hold while ``loop`` of ``cell`` runs; undone after it."""
        if cell.case == REPLAY and first_loop:
            self.post(cell, self.key(cell, loop, 0), 201, replayed=False)
        if cell.case != CONFLICT:
            yield
            return
        with InFlight(self, cell, self.key(cell, loop, 0)):
            yield

    def send(self, cell: Cell, loop: str, index: int) -> None:
        """Request ``index`` of ``loop``, checked: its status, and whether it replayed."""
        self.post(cell, self.key(cell, loop, index), cell.status, cell.case == REPLAY)

    def run(self, cell: Cell, loop: str, count: int) -> None:
        for index in range(count):
            self.send(cell, loop, index)


class InFlight:
    """A first execution held inside its view, its claim committed: duplicates meet it in flight.

    A second connection locks the business table (EXCLUSIVE: reads pass,
    the view's INSERT waits); the first request runs in a thread and is
    waiting on that lock when ``__enter__`` returns. On exit the lock is
    released and the first request must finish with 201. A watchdog
    releases the lock after ``limit`` seconds whatever happens, so that a
    design whose duplicates wait instead of answering cannot hang the run
    (its loop then fails on an unexpected answer).
    """

    def __init__(self, driver: Driver, cell: Cell, key: str | None, limit: float = 300.0) -> None:
        self.driver = driver
        self.cell = cell
        self.key = key
        self.limit = limit
        self.failure: BaseException | None = None
        self._locker: psycopg.Connection[Any] | None = None
        self._released = threading.Lock()
        self._thread = threading.Thread(target=self._first, name="in-flight", daemon=True)
        self._watchdog = threading.Timer(limit, self._release)

    def _first(self) -> None:
        from django.db import connections
        from django.test import Client

        try:
            response = Client().post(
                self.cell.variant.path,
                BODY,
                content_type="application/json",
                headers={"Idempotency-Key": self.key or ""},
            )
            if response.status_code != 201:
                raise UnexpectedAnswer(
                    f"{self.cell.name}: the request in flight answered {response.status_code}: "
                    f"{response.content[:300]!r}"
                )
        except BaseException as failure:
            self.failure = failure
        finally:
            connections.close_all()  # this thread's connection

    def _release(self) -> None:
        with self._released:
            locker, self._locker = self._locker, None
        if locker is not None:
            locker.rollback()
            locker.close()

    def __enter__(self) -> InFlight:
        locker = psycopg.connect(self.driver.locker_url, connect_timeout=5)
        locker.execute(f"LOCK TABLE {BUSINESS_TABLE} IN EXCLUSIVE MODE")
        pid = locker.info.backend_pid
        self._locker = locker
        self._watchdog.start()
        self._thread.start()
        with psycopg.connect(self.driver.locker_url, autocommit=True) as watcher:
            deadline = time.monotonic() + self.limit
            while True:
                row = watcher.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND wait_event_type = 'Lock' AND %s = ANY(pg_blocking_pids(pid))",
                    [pid],
                ).fetchone()
                if row is not None and row[0] >= 1:
                    break
                if not self._thread.is_alive() or time.monotonic() > deadline:
                    self.__exit__(None, None, None)
                    raise UnexpectedAnswer(
                        f"{self.cell.name}: the first request never waited inside its view"
                    )
                time.sleep(0.02)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._watchdog.cancel()
        self._release()
        self._thread.join(timeout=self.limit)
        if self.failure is not None and exc_info[0] is None:
            raise self.failure
