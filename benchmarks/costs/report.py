"""The cost table, the release's targets and the block of docs/performance.md, from the figures.

Figures are plain dicts (what ``--json`` writes), so that a committed
baseline (benchmarks/figures/) and this run's are read alike: every figure
shows "before → now" when it moved, its value alone when not.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.costs.cells import CONFLICT, FIRST, REPLAY, VARIANTS
from benchmarks.costs.writes import short

BEGIN = "<!-- request-costs:begin -->"
END = "<!-- request-costs:end -->"
#: Instructions that moved less than this (relative) are shown as unchanged: where the
#: heap's objects land alone moves a figure by up to about 0.5 % (the runs' spread, given
#: with the table), so a smaller move says nothing about the code.
INSTRUCTIONS_UNCHANGED = 0.01
CASE_LABEL = {FIRST: "first execution", REPLAY: "replay", CONFLICT: "409 (duplicate in flight)"}

Figures = dict[str, Any]


def number(value: float) -> str:
    """An integer when it is one, else up to three decimals (0.995 is not 1)."""
    if abs(value - round(value)) < 1e-9:
        return f"{round(value):,}"
    return f"{value:,.3f}".rstrip("0")


def rows_updated(cell: Figures) -> str:
    if not cell["rows_updated"]:
        return "0"
    return f"{number(cell['rows_updated'])} ({number(cell['rows_hot'])} HOT)"


def instructions(cell: Figures) -> str:
    value = cell.get("instructions")
    return "" if value is None else f"{value / 1000:,.0f}k"


@dataclass(frozen=True)
class Column:
    title: str
    text: Callable[[Figures], str]
    #: The figure compared with the baseline (None: compare the text).
    key: str | None = None


COLUMNS = (
    Column("round trips", lambda cell: number(cell["round_trips"])),
    Column("statements", lambda cell: number(cell["statements"])),
    Column("rows inserted", lambda cell: number(cell["rows_inserted"])),
    Column("rows updated", rows_updated),
    Column("rows deleted", lambda cell: number(cell["rows_deleted"])),
    Column("index entries", lambda cell: number(cell["index_entries"])),
    Column("WAL bytes", lambda cell: f"{cell['wal_bytes']:,.0f}"),
    Column("instructions", instructions, key="instructions"),
)


def moved(before: str, now: str) -> str:
    return now if before in ("", now) else f"{before} → {now}"


def figure_text(column: Column, now: Figures, before: Figures | None) -> str:
    text = column.text(now)
    if before is None:
        return text
    if column.key is not None:
        old, new = before.get(column.key), now.get(column.key)
        if old and new and abs(new - old) / old < INSTRUCTIONS_UNCHANGED:
            return text
    return moved(column.text(before), text)


def cell_order(figures: Figures) -> list[str]:
    order = {(variant.name, case): i for i, variant in enumerate(VARIANTS) for case in CASE_LABEL}
    names = list(figures["cells"])
    return sorted(names, key=lambda name: order.get(_design_case(figures, name), (99, name)))


def _design_case(figures: Figures, name: str) -> tuple[str, str]:
    cell = figures["cells"][name]
    return str(cell["design"]), str(cell["case"])


def cost_table(now: Figures, before: Figures | None) -> list[str]:
    """One row per cell, in the designs' order; a design answering no 409 says so in its place."""
    lines = [
        "| design | request | " + " | ".join(column.title for column in COLUMNS) + " |",
        "|---|---|" + "---:|" * len(COLUMNS),
    ]
    old_cells = before["cells"] if before else {}
    blank = " | ".join("" for _ in COLUMNS)
    notes = footnotes(now)
    names = cell_order(now)
    for position, name in enumerate(names):
        cell = now["cells"][name]
        figures = [figure_text(column, cell, old_cells.get(name)) for column in COLUMNS]
        lines.append(
            f"| {cell['design']} | {CASE_LABEL[cell['case']]} | " + " | ".join(figures) + " |"
        )
        last_of_design = position + 1 == len(names) or (
            now["cells"][names[position + 1]]["design"] != cell["design"]
        )
        if last_of_design and cell["design"] in now.get("no_409", {}):
            mark = notes[now["no_409"][cell["design"]]]
            lines.append(f"| {cell['design']} | 409: none ({mark}) | {blank} |")
    return lines


def footnotes(figures: Figures) -> dict[str, str]:
    """A letter for each distinct reason a design answers no 409."""
    reasons = dict.fromkeys(figures.get("no_409", {}).values())
    return {reason: "abcdefgh"[number] for number, reason in enumerate(reasons)}


def footnote_lines(figures: Figures) -> list[str]:
    lines = []
    for reason, mark in footnotes(figures).items():
        designs = [design for design, why in figures["no_409"].items() if why == reason]
        lines.append(f"({mark}) {' and '.join(designs)}: {reason}.")
    return lines


def _index_shape(index: Figures) -> str:
    """``(columns) WHERE predicate``, from the index's definition."""
    definition = str(index["definition"])
    found = re.search(r" USING (\w+) (\(.*)$", definition)
    if found is None:
        return definition
    method, rest = found[1], found[2]
    rest = re.sub(r" WITH \(.*?\)", "", rest)
    return rest if method == "btree" else f"{method} {rest}"


def index_table(now: Figures, before: Figures | None) -> list[str]:
    """Entries per request by index, for the cells that write any: what each index costs."""
    old = before or {"cells": {}, "indexes": []}

    def writes_any(cell: Figures | None) -> bool:
        return bool(cell and (cell["index_entries"] or cell["other_index_records"]))

    names = [
        name
        for name in cell_order(now)
        if writes_any(now["cells"][name]) or writes_any(old["cells"].get(name))
    ]
    indexes: dict[str, Figures] = {}
    for index in [*old["indexes"], *now["indexes"]]:
        indexes[index["name"]] = index
    present_now = {index["name"] for index in now["indexes"]}
    present_before = {index["name"] for index in old["indexes"]}
    lines = [
        "| table | index | on | " + " | ".join(_cell_heading(now, name) for name in names) + " |",
        "|---|---|---|" + "---:|" * len(names),
    ]
    for index in sorted(indexes.values(), key=lambda found: (short(found["table"]), found["name"])):
        name = index["name"]
        added_or_dropped = before is not None and (name in present_now) != (name in present_before)
        cells_then_and_now = [now["cells"][cell] for cell in names]
        cells_then_and_now += [old["cells"][cell] for cell in names if cell in old["cells"]]
        if not added_or_dropped and not any(_wrote(cell, name) for cell in cells_then_and_now):
            continue
        texts = [
            moved(
                _entries(old["cells"].get(cell), index, present_before) if before else "",
                _entries(now["cells"][cell], index, present_now),
            )
            for cell in names
        ]
        lines.append(
            f"| {short(index['table'])} | {name} | {_index_shape(index)} | "
            + " | ".join(texts)
            + " |"
        )
    return lines


def _cell_heading(figures: Figures, name: str) -> str:
    design, case = _design_case(figures, name)
    return design if case == FIRST else f"{design} ({CASE_LABEL[case]})"


def _wrote(cell: Figures, index: str) -> bool:
    return bool(cell["index_entries_by_index"].get(index) or cell["other_index_records"].get(index))


def _entries(cell: Figures | None, index: Figures, present: set[str]) -> str:
    """The index's entries per request in ``cell``; blank where the cell left its table alone."""
    if cell is None or short(index["table"]) not in cell["rows"]:
        return ""
    name = index["name"]
    if name not in present:
        return "—"
    if name in cell["other_index_records"]:
        return f"{number(cell['other_index_records'][name])} (records)"
    return number(cell["index_entries_by_index"].get(name, 0))


def targets_table(targets: list[Figures]) -> list[str]:
    lines = ["| target | before | now | verdict |", "|---|---:|---:|---|"]
    for target in targets:
        lines.append(
            f"| {target['what']} | {target['before'] or ''} | {target['now'] or ''} "
            f"| {target['verdict']} |"
        )
    return lines


def machine_line(figures: Figures) -> str:
    m = figures["measured"]
    server = "a server of the script's own" if m.get("server") == "own" else "the shared server"
    instructions = (
        f"{m['valgrind']}, loops of {m['loops'][0]} and {m['loops'][1]} requests, {m['runs']} runs"
        if m["runs"]
        else "no instructions counted"
    )
    return (
        f"Measured on {m['cpus']} x {m['cpu']}, {m['memory']}; Python {m['python']}, "
        f"Django {m['django']}, DRF {m['drf']}, psycopg {m['psycopg']}; PostgreSQL "
        f"{m['server_version']} ({server}); {m['requests']} requests counted per cell; "
        # The commit stays in the JSON: the docs name no commits.
        f"{instructions}."
    )


def block(now: Figures, before: Figures | None) -> str:
    """The generated part of docs/performance.md's "Per request, counted"."""
    lines = [machine_line(now)]
    if before is not None:
        lines.append(
            f"Before: {before['label']}, "
            f"`{before['path']}`; a figure that moved shows before → now."
        )
    lines += ["", *cost_table(now, before), "", *footnote_lines(now)]
    spread = now.get("repeatability")
    if spread:
        lines += [
            "",
            f"Instructions: the mean of {spread['runs']} runs, each with its heap shifted "
            f"otherwise, which differed by at most {spread['max_relative']:.2%} "
            f"({spread['max_absolute']:,.0f} instructions per request, {spread['cell']}).",
        ]
    lines += [
        "",
        "Index entries per request, by index (read from the catalog; BRIN indexes take no "
        "entry per row: their records are counted):",
        "",
        *index_table(now, before),
        "",
        "The release's performance targets:",
        "",
        *targets_table(now["targets"]),
    ]
    return "\n".join(lines)


def write_docs(path: Path, text: str) -> None:
    content = path.read_text()
    start, end = content.find(BEGIN), content.find(END)
    if start < 0 or end < start:
        raise RuntimeError(f"{path}: no {BEGIN} ... {END} markers")
    path.write_text(content[: start + len(BEGIN)] + "\n" + text + "\n" + content[end:])
