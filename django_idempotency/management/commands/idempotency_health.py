"""``manage.py idempotency_health``: the census of each records database, and thresholds.

Exit status (docs/commands.md): 0 healthy; 1 a threshold crossed; 2 a records
database could not be read (the others still reported and judged; 2 wins
over 1); 3 a usage error (a ``CommandError`` with ``returncode=3``, also
for an unknown option or a malformed value on the command line, where
argparse would exit 2 and be taken for an unreadable database).
"""

from __future__ import annotations

import json
import logging
import re
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DatabaseError

from django_idempotency import census
from django_idempotency._store.clock import to_the_second
from django_idempotency._store.routing import records_database_named
from django_idempotency.census import Census, take_census
from django_idempotency.management.arguments import add_database_argument
from django_idempotency.management.terminal import printable
from django_idempotency.models import UNRESOLVED_STATES, IdempotencyRecord

HEALTHY, THRESHOLD_CROSSED, UNREADABLE, USAGE_ERROR = 0, 1, 2, 3

_STATUS_TEXT = {
    HEALTHY: "healthy",
    THRESHOLD_CROSSED: "threshold crossed",
    UNREADABLE: "a records database could not be read",
}

_DURATION = re.compile(r"(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s)?")


logger = logging.getLogger("django_idempotency")


def duration(text: str) -> float:
    """An argparse type: seconds (``900``), or a duration such as ``15m``, ``1h30m``, ``2d``."""
    import argparse

    value = text.strip().lower()
    if re.fullmatch(r"\d+(?:\.\d+)?", value):
        return float(value)
    match = _DURATION.fullmatch(value)
    if not value or match is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration: seconds (900) or e.g. 15m, 1h30m, 2d"
        )
    days, hours, minutes, seconds = (float(part or 0) for part in match.groups())
    return timedelta(days=days, hours=hours, minutes=minutes, seconds=seconds).total_seconds()


def count(text: str) -> int:
    """An argparse type: a whole number of at least 0."""
    import argparse

    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 0")
    return int(text)


def human(seconds: float) -> str:
    """``3h 5m``: the two largest units."""
    whole, parts = int(seconds), []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        amount, whole = divmod(whole, size)
        if amount:
            parts.append(f"{amount}{unit}")
    return " ".join(parts[:2]) or "0s"


@dataclass(frozen=True)
class Crossed:
    """One threshold crossed in one database."""

    database: str
    option: str
    limit: float
    value: float
    text: str


def crossed(taken: Census, options: dict[str, Any]) -> list[Crossed]:
    """The thresholds given as options that ``taken`` crosses."""
    found = []

    def over(option: str, value: float, text: str, *, age: bool = False) -> None:
        limit = options[option.lstrip("-").replace("-", "_")]
        if limit is not None and value > limit:
            shown = human(limit) if age else f"{limit:,}"
            found.append(Crossed(taken.database, option, limit, value, f"{text}, over {shown}"))

    uncertain_age = taken.age(IdempotencyRecord.State.UNCERTAIN)
    if uncertain_age is not None:
        seconds = uncertain_age.total_seconds()
        over(
            "--max-uncertain-age",
            seconds,
            f"oldest UNCERTAIN record {human(seconds)} old",
            age=True,
        )
    if taken.oldest_unresolved_age is not None:
        seconds = taken.oldest_unresolved_age.total_seconds()
        over(
            "--max-unresolved-age",
            seconds,
            f"oldest unresolved record {human(seconds)} old",
            age=True,
        )
    uncertain = taken.counts[IdempotencyRecord.State.UNCERTAIN]
    over("--max-uncertain", uncertain, f"{uncertain} UNCERTAIN record(s)")
    at_least = "at least " if taken.purge_backlog_capped else ""
    over(
        "--max-purge-backlog", taken.purge_backlog, f"purge backlog {at_least}{taken.purge_backlog}"
    )
    if options["fail_on_unreconciled"] and taken.unreconciled_operations:
        names = ", ".join(map(printable, taken.unreconciled_operations))
        found.append(
            Crossed(
                taken.database,
                "--fail-on-unreconciled",
                0,
                len(taken.unreconciled_operations),
                f"operations without a reconciler: {names}",
            )
        )
    return found


def as_json(alias: str, taken: Census | None, error: str | None) -> dict[str, Any]:
    """One database's entry of ``--format json``: the same keys whether it was read or not."""
    ages = {
        state: None if taken is None else _seconds(taken.age(state)) for state in UNRESOLVED_STATES
    }
    return {
        "database": alias,
        "error": error,
        "taken_at": None if taken is None else taken.taken_at.isoformat(),
        "counts": None if taken is None else dict(taken.counts),
        "estimated": None if taken is None else sorted(taken.estimated),
        "oldest_age_seconds": ages,
        "oldest_unresolved_age_seconds": None
        if taken is None
        else _seconds(taken.oldest_unresolved_age),
        "purge_backlog": None if taken is None else taken.purge_backlog,
        "purge_backlog_capped": None if taken is None else taken.purge_backlog_capped,
        "unreconciled_operations": None if taken is None else list(taken.unreconciled_operations),
    }


def _seconds(age: timedelta | None) -> float | None:
    return None if age is None else round(age.total_seconds(), 3)


class Command(BaseCommand):
    help = (
        "Report the idempotency records of each records database: counts per state "
        "(resolved ones estimated on large tables), the age of the oldest unresolved "
        "record per state, the purge backlog, operations with IN_PROGRESS or UNCERTAIN "
        "records and no reconciler. Exit status: 0 healthy, 1 a threshold crossed, "
        "2 a records database could not be read, 3 a usage error."
    )

    # A probe runs this every few seconds: the system checks (0.17 s of
    # CPU in the test project, measured) are `manage.py check`'s job at deploy.
    requires_system_checks: list[str] = []

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> CommandParser:
        parser = super().create_parser(prog_name, subcommand, **kwargs)

        def usage_error(message: str) -> NoReturn:
            if parser.called_from_command_line:
                parser.print_usage(sys.stderr)
                parser.exit(USAGE_ERROR, f"{parser.prog}: error: {message}\n")
            raise CommandError(f"Error: {message}", returncode=USAGE_ERROR)

        parser.error = usage_error  # type: ignore[method-assign]
        return parser

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--max-uncertain-age",
            type=duration,
            metavar="DURATION",
            help="exit 1 if an UNCERTAIN record is older (seconds, or e.g. 15m, 2h)",
        )
        parser.add_argument(
            "--max-unresolved-age",
            type=duration,
            metavar="DURATION",
            help="exit 1 if a CLAIMED, IN_PROGRESS or UNCERTAIN record is older",
        )
        parser.add_argument(
            "--max-uncertain",
            type=count,
            metavar="COUNT",
            help="exit 1 if there are more UNCERTAIN records (in one database)",
        )
        parser.add_argument(
            "--max-purge-backlog",
            type=count,
            metavar="COUNT",
            help=f"exit 1 if more records are past retention (below {census.BACKLOG_CAP:,})",
        )
        parser.add_argument(
            "--fail-on-unreconciled",
            action="store_true",
            help="exit 1 if IN_PROGRESS or UNCERTAIN records belong to an operation "
            "without a registered reconciler",
        )
        parser.add_argument("--format", choices=["text", "json"], default="text")
        add_database_argument(parser)

    def handle(self, *args: Any, database: str | None, format: str, **options: Any) -> None:
        backlog_limit = options["max_purge_backlog"]
        if backlog_limit is not None and backlog_limit >= census.BACKLOG_CAP:
            raise CommandError(
                f"--max-purge-backlog must be below {census.BACKLOG_CAP:,}: the backlog is "
                "counted up to there, and reported as 'at least' beyond it.",
                returncode=USAGE_ERROR,
            )
        entries: list[tuple[str, Census | None, str | None]] = []
        for alias in records_database_named(database):
            try:
                entries.append((alias, take_census(alias), None))
            except Exception as exc:
                # Any failure to read is status 2, never 1: a probe must not
                # take an alias missing from DATABASES for a crossed threshold.
                if not isinstance(exc, DatabaseError):
                    logger.exception("Could not take the census of %r.", alias)
                # On one line, and without what a terminal acts on: a
                # database's message may quote stored values.
                text = printable(" ".join(str(exc).split()))
                entries.append((alias, None, text or type(exc).__name__))
        found = [item for _, taken, _ in entries if taken for item in crossed(taken, options)]
        unreadable = [alias for alias, taken, _ in entries if taken is None]
        status = UNREADABLE if unreadable else THRESHOLD_CROSSED if found else HEALTHY
        if format == "json":
            self.stdout.write(json.dumps(self._json(entries, found, status), indent=2))
        else:
            self._text(entries, found, status)
        if status != HEALTHY:
            sys.exit(status)

    def _json(
        self,
        entries: list[tuple[str, Census | None, str | None]],
        found: list[Crossed],
        status: int,
    ) -> dict[str, Any]:
        return {
            "status": status,
            "healthy": status == HEALTHY,
            "databases": [as_json(alias, taken, error) for alias, taken, error in entries],
            "crossed": [
                {
                    "database": item.database,
                    "option": item.option,
                    "limit": item.limit,
                    "value": item.value,
                    "text": item.text,
                }
                for item in found
            ],
        }

    def _text(
        self,
        entries: list[tuple[str, Census | None, str | None]],
        found: list[Crossed],
        status: int,
    ) -> None:
        for alias, taken, error in entries:
            if taken is None:
                self.stderr.write(f"{alias}: could not be read: {error}")
                self.stdout.write(f"{alias}: COULD NOT BE READ ({error})")
                continue
            self.stdout.write(f"{alias} (at {to_the_second(taken.taken_at)}, the database's clock)")
            for state, number in taken.counts.items():
                about = "about " if state in taken.estimated else ""
                age = taken.age(state)
                oldest = "" if age is None else f"  oldest {human(age.total_seconds())} old"
                self.stdout.write(f"  {state:<12}{about:>6}{number:>12,}{oldest}")
            at_least = "at least " if taken.purge_backlog_capped else ""
            self.stdout.write(f"  purge backlog: {at_least}{taken.purge_backlog:,} record(s)")
            if taken.unreconciled_operations:
                self.stdout.write(
                    "  no reconciler for operations with IN_PROGRESS or UNCERTAIN records: "
                    + ", ".join(map(printable, taken.unreconciled_operations))
                )
        for item in found:
            self.stdout.write(f"THRESHOLD CROSSED {item.database}: {item.text} ({item.option})")
        self.stdout.write(f"status: {_STATUS_TEXT[status]}")
