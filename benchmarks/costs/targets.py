"""The release's deterministic performance targets, judged on the figures.

Three kinds: a ratio of two cells' figures at most a bound (instructions),
a cell's figure at most another's (round trips), and a cell's figure below
the baseline's (index entries and WAL bytes "lower than today's").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

RATIO = "ratio at most"
NO_MORE = "no more than"
BELOW_BASELINE = "below the baseline"

DEFAULT_FIRST = "package default, first execution"
DEFAULT_REPLAY = "package default, replay"
OPTIMISTIC_FIRST = "package optimistic, first execution"
OPTIMISTIC_REPLAY = "package optimistic, replay"
FLOOR_FIRST = "floor, first execution"
FLOOR_REPLAY = "floor, replay"
FLOOR_OPTIMISTIC_FIRST = "floor optimistic, first execution"


@dataclass(frozen=True)
class Target:
    what: str
    figure: str
    cell: str
    kind: str
    reference: str = ""
    bound: float = 0.0


TARGETS = (
    Target(
        "instructions, default first execution / floor's, at most 1.2x",
        "instructions", DEFAULT_FIRST, RATIO, FLOOR_FIRST, 1.2,
    ),
    Target(
        "instructions, default replay / floor replay's, at most 1.0x",
        "instructions", DEFAULT_REPLAY, RATIO, FLOOR_REPLAY, 1.0,
    ),
    Target(
        "instructions, optimistic replay / floor replay's, at most 1.0x",
        "instructions", OPTIMISTIC_REPLAY, RATIO, FLOOR_REPLAY, 1.0,
    ),
    Target(
        "instructions, optimistic first execution / floor optimistic's, at most 1.2x "
        "(no bound of its own: the default mode's)",
        "instructions", OPTIMISTIC_FIRST, RATIO, FLOOR_OPTIMISTIC_FIRST, 1.2,
    ),
    Target(
        "round trips, default first execution, no more than the floor's",
        "round_trips", DEFAULT_FIRST, NO_MORE, FLOOR_FIRST,
    ),
    Target(
        "round trips, optimistic first execution, no more than floor optimistic's",
        "round_trips", OPTIMISTIC_FIRST, NO_MORE, FLOOR_OPTIMISTIC_FIRST,
    ),
    Target(
        "round trips, default replay, no more than the floor replay's",
        "round_trips", DEFAULT_REPLAY, NO_MORE, FLOOR_REPLAY,
    ),
    Target(
        "round trips, optimistic replay, no more than the floor replay's",
        "round_trips", OPTIMISTIC_REPLAY, NO_MORE, FLOOR_REPLAY,
    ),
    Target(
        "index entries, default first execution, lower than before",
        "index_entries", DEFAULT_FIRST, BELOW_BASELINE,
    ),
    Target(
        "index entries, optimistic first execution, lower than before",
        "index_entries", OPTIMISTIC_FIRST, BELOW_BASELINE,
    ),
    Target(
        "WAL bytes, default first execution, lower than before",
        "wal_bytes", DEFAULT_FIRST, BELOW_BASELINE,
    ),
    Target(
        "WAL bytes, optimistic first execution, lower than before",
        "wal_bytes", OPTIMISTIC_FIRST, BELOW_BASELINE,
    ),
)  # fmt: skip


def _value(figures: dict[str, Any] | None, cell: str, figure: str) -> float | None:
    if figures is None or cell not in figures["cells"]:
        return None
    value = figures["cells"][cell].get(figure)
    return None if value is None else float(value)


def _ratio(figures: dict[str, Any] | None, target: Target) -> float | None:
    value = _value(figures, target.cell, target.figure)
    reference = _value(figures, target.reference, target.figure)
    if value is None or not reference:
        return None
    return value / reference


def _pair(figures: dict[str, Any] | None, target: Target) -> str:
    value = _value(figures, target.cell, target.figure)
    reference = _value(figures, target.reference, target.figure)
    if value is None or reference is None:
        return ""
    return f"{value:g} vs {reference:g}"


def _amount(value: float | None) -> str:
    return "" if value is None else f"{value:,.0f}" if value >= 100 else f"{value:g}"


def evaluate(now: dict[str, Any], before: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Each target with its figure before and now, and whether now meets it."""
    judged = []
    for target in TARGETS:
        met: bool | None
        if target.kind == RATIO:
            ratio, old = _ratio(now, target), _ratio(before, target)
            now_text = "" if ratio is None else f"{ratio:.2f}x"
            before_text = "" if old is None else f"{old:.2f}x"
            met = None if ratio is None else ratio <= target.bound + 1e-9
        elif target.kind == NO_MORE:
            value = _value(now, target.cell, target.figure)
            reference = _value(now, target.reference, target.figure)
            now_text, before_text = _pair(now, target), _pair(before, target)
            met = None if value is None or reference is None else value <= reference
        else:
            value = _value(now, target.cell, target.figure)
            old_value = _value(before, target.cell, target.figure)
            now_text, before_text = _amount(value), _amount(old_value)
            met = None if value is None or old_value is None else value < old_value
        if met is None:
            verdict = "no baseline" if target.kind == BELOW_BASELINE else "not measured"
        else:
            verdict = "met" if met else "not met"
        judged.append(
            {
                "what": target.what,
                "before": before_text,
                "now": now_text,
                "met": met,
                "verdict": verdict,
            }
        )
    return judged
