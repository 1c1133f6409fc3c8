"""A real streaming replica for the live tests: a primary of the test's own and a hot standby.

The machine's shared server (port 5432) allows no replication connection
and must not be reconfigured: other test runs use it. So ``replicated()``
builds a pair of its own:

- the primary is an ``OwnPostgres`` (``own_postgres.py``: ``initdb`` into a
  temporary directory, a free port, trust authentication). ``initdb``'s
  ``pg_hba.conf`` already lets ``replication`` connect from 127.0.0.1 with
  the method it was given (trust); ``wal_level=replica`` and a few WAL
  senders are set explicitly all the same, so that the pair does not hang
  on a packaged default changing;
- the standby (``Standby``) is ``pg_basebackup -R -X stream`` from that
  primary into a second temporary directory (``-R`` writes
  ``standby.signal`` and ``primary_conninfo``), started with
  ``hot_standby=on`` on a free port of its own, as the ``postgres`` OS
  user when the tests run as root (as ``OwnPostgres`` does);
- ``Standby.start()`` returns once the standby answers reads and says it is
  in recovery.

``pause_replay()`` stands for replication lag: ``pg_wal_replay_pause()``
on the standby, then wait until ``pg_get_wal_replay_pause_state()`` says
``paused`` (the startup process notices the request only when it next
looks at WAL, so the wait writes a WAL message on the primary as a nudge).
From then on, nothing the primary commits reaches the standby's readers
until ``resume_replay()``. ``wait_caught_up()`` waits until the standby has
replayed everything the primary had written when it was called.

On exit both servers stop (``-m immediate``) and both directories go,
also when the test failed. Missing binaries (``pg_basebackup`` besides
those ``OwnPostgres`` needs) skip the test, or fail it under
``IDEMPOTENCY_REQUIRE_SERVICES=1``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.live.own_postgres import OwnPostgres, require_own_postgres
from tests.live.services import REQUIRE_SERVICES_ENV, services_required

__all__ = [
    "PRIMARY_SETTINGS",
    "Standby",
    "replicated",
    "require_replication_binaries",
]

#: What the primary needs for one streaming standby (and pg_basebackup's own
#: WAL stream while it copies).
PRIMARY_SETTINGS = ("wal_level=replica", "max_wal_senders=5", "max_replication_slots=5")
READY_TIMEOUT = 30.0
PAUSE_TIMEOUT = 15.0
CATCH_UP_TIMEOUT = 30.0


def require_replication_binaries() -> Path:
    """The binaries' directory (with ``pg_basebackup``); else skip or, in CI, fail."""
    bindir = require_own_postgres()
    if not (bindir / "pg_basebackup").is_file():
        problem = f"pg_basebackup not found in {bindir}"
        if services_required():
            pytest.fail(
                f"a streaming replica is required ({REQUIRE_SERVICES_ENV}=1) but cannot be "
                f"made: {problem}",
                pytrace=False,
            )
        pytest.skip(f"cannot make a streaming replica: {problem}")
    return bindir


class Standby(OwnPostgres):
    """A hot standby of ``primary``, made by ``pg_basebackup``; ``with Standby(primary): ...``."""

    def __init__(self, primary: OwnPostgres) -> None:
        super().__init__(primary.bindir, label="standby", settings=("hot_standby=on",))
        self.primary = primary

    def __enter__(self) -> Standby:
        super().__enter__()
        return self

    def _make_data_dir(self) -> None:
        self._run(
            "pg_basebackup",
            "-h", "127.0.0.1", "-p", str(self.primary.port), "-U", "postgres",
            "-D", str(self.data_dir),
            "-R",  # standby.signal and primary_conninfo: start as a streaming standby
            "-X", "stream",
            "-c", "fast",  # an immediate checkpoint on the primary, not a spread one
            "--no-sync",
            timeout=120,
        )  # fmt: skip

    def start(self) -> float:
        """Start and wait until the standby answers reads, in recovery; seconds taken."""
        started = time.monotonic()
        super().start()
        deadline = time.monotonic() + READY_TIMEOUT
        problem = "no answer"
        while time.monotonic() < deadline:
            try:
                with self._connect() as connection:
                    row = connection.execute("SELECT pg_is_in_recovery()").fetchone()
                if row is not None and row[0] is True:
                    return time.monotonic() - started
                problem = "it is not in recovery (it is no standby)"
            except psycopg.Error as exc:
                problem = " ".join(str(exc).split())
            time.sleep(0.1)
        raise RuntimeError(f"the standby does not accept reads: {problem}\n" + self.log_tail())

    # -- replay -----------------------------------------------------------------------

    def pause_replay(self) -> float:
        """Stop applying the primary's WAL (replication lag); returns once paused."""
        started = time.monotonic()
        with self._connect() as connection:
            connection.execute("SELECT pg_wal_replay_pause()")
            deadline = time.monotonic() + PAUSE_TIMEOUT
            while self._pause_state(connection) != "paused":
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"replay not paused after {PAUSE_TIMEOUT:.0f}s: "
                        f"{self._pause_state(connection)}\n" + self.log_tail()
                    )
                self._nudge_primary()
                time.sleep(0.05)
        return time.monotonic() - started

    def resume_replay(self) -> None:
        with self._connect() as connection:
            connection.execute("SELECT pg_wal_replay_resume()")
            if self._pause_state(connection) != "not paused":
                raise RuntimeError("replay did not resume")

    def replay_paused(self) -> bool:
        with self._connect() as connection:
            return self._pause_state(connection) == "paused"

    def wait_caught_up(self) -> float:
        """Wait until everything the primary has written so far is replayed here."""
        started = time.monotonic()
        with psycopg.connect(self.primary.url(), autocommit=True, connect_timeout=5) as primary:
            row = primary.execute("SELECT pg_current_wal_lsn()::text").fetchone()
        assert row is not None
        target = row[0]
        deadline = time.monotonic() + CATCH_UP_TIMEOUT
        with self._connect() as connection:
            while True:
                behind = connection.execute(
                    "SELECT pg_wal_lsn_diff(%s::pg_lsn, pg_last_wal_replay_lsn())", [target]
                ).fetchone()
                if behind is not None and behind[0] is not None and behind[0] <= 0:
                    return time.monotonic() - started
                if self._pause_state(connection) != "not paused":
                    raise RuntimeError("wait_caught_up() with replay paused: it never will")
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the standby is {behind} bytes behind after {CATCH_UP_TIMEOUT:.0f}s\n"
                        + self.log_tail()
                    )
                time.sleep(0.05)

    # -- helpers ----------------------------------------------------------------------

    def _connect(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self.url(), autocommit=True, connect_timeout=5)

    @staticmethod
    def _pause_state(connection: psycopg.Connection[Any]) -> str:
        row = connection.execute("SELECT pg_get_wal_replay_pause_state()").fetchone()
        return str(row[0]) if row is not None else "?"

    def _nudge_primary(self) -> None:
        """Write one WAL record on the primary, for the standby's startup process to see."""
        with psycopg.connect(self.primary.url(), autocommit=True, connect_timeout=5) as primary:
            primary.execute("SELECT pg_logical_emit_message(false, 'idempotency-tests', 'nudge')")


@contextlib.contextmanager
def replicated() -> Iterator[tuple[OwnPostgres, Standby]]:
    """A primary of the test's own and a hot standby streaming from it; both gone afterwards."""
    bindir = require_replication_binaries()
    with (
        OwnPostgres(bindir, label="primary", settings=PRIMARY_SETTINGS) as primary,
        Standby(primary) as standby,
    ):
        yield primary, standby
