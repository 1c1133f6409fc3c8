"""Bar charts as geometry for an inline SVG template: no JavaScript, nothing fetched.

The admin must work offline, with no script from a CDN, so the overview's
charts are drawn on the server: ``bar_chart()`` lays out
(stacked) bars, axis ticks and labels in SVG user units, and the template
``admin/django_idempotency/idempotencyrecord/svg_chart.html`` writes them
out, with a ``<title>`` and ``<desc>`` for screen readers, a ``<title>`` on
every bar, and the figures again as a plain table.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

WIDTH = 720
HEIGHT = 260
#: Room for the y axis's labels (left), the x axis's (bottom) and their titles.
LEFT, RIGHT, TOP, BOTTOM = 64, 12, 12, 52
Y_TICKS = 4


@dataclass(frozen=True)
class Series:
    """One layer of the bars: a value per category, drawn in ``css_class``."""

    name: str
    label: str
    css_class: str
    values: Sequence[int]


@dataclass(frozen=True)
class Bar:
    x: float
    y: float
    width: float
    height: float
    css_class: str
    series: str
    value: int
    #: What a pointer over the bar (and a screen reader) is told.
    title: str


@dataclass(frozen=True)
class Tick:
    position: float
    label: str


@dataclass(frozen=True)
class Row:
    """A line of the fallback table: the category and each series' value."""

    label: str
    values: tuple[int, ...]


@dataclass(frozen=True)
class Chart:
    """Everything the template draws, in SVG user units (``width`` x ``height``)."""

    identifier: str
    title: str
    description: str
    width: int
    height: int
    left: float
    top: float
    right: float
    bottom: float
    x_axis_label: str
    y_axis_label: str
    bars: tuple[Bar, ...]
    y_ticks: tuple[Tick, ...]
    x_ticks: tuple[Tick, ...]
    series: tuple[Series, ...]
    rows: tuple[Row, ...]

    @property
    def x_axis_label_y(self) -> float:
        return self.height - 8

    @property
    def middle_x(self) -> float:
        return (self.left + self.right) / 2

    @property
    def middle_y(self) -> float:
        return (self.top + self.bottom) / 2


def nice_ceiling(value: float) -> int:
    """The smallest round number (1, 2, 2.5, 3, 4, 5, 6 or 8 times a power of ten) >= ``value``.

    At least 1, and a whole number: the ticks count records.
    """
    if value <= 1:
        return 1
    power: int = 10 ** math.floor(math.log10(value))
    for step in (1, 2, 2.5, 3, 4, 5, 6, 8, 10):
        candidate = step * power
        if candidate >= value and candidate == int(candidate):
            return int(candidate)
    return 10 * power


def compact_number(value: float) -> str:
    """1200 -> "1.2k", 3000000 -> "3M": for axis labels."""
    for divisor, suffix in ((1_000_000_000, "G"), (1_000_000, "M"), (1_000, "k")):
        if abs(value) >= divisor:
            shown = f"{value / divisor:.1f}".removesuffix(".0")
            return f"{shown}{suffix}"
    return f"{value:g}"


def bar_chart(
    *,
    identifier: str,
    title: str,
    description: str,
    categories: Sequence[str],
    series: Sequence[Series],
    x_axis_label: str,
    y_axis_label: str,
    label_every: int = 1,
    tick_labels: Sequence[str] | None = None,
    width: int = WIDTH,
    height: int = HEIGHT,
) -> Chart:
    """Bars per category, the ``series`` stacked in order (the first at the bottom).

    Every ``label_every``-th category is written under the x axis (as its
    ``tick_labels`` entry, if given: a shorter form); every one is in full in
    each bar's title and in the table.
    """
    left, right, top, bottom = LEFT, width - RIGHT, TOP, height - BOTTOM
    totals = [sum(layer.values[index] for layer in series) for index in range(len(categories))]
    ceiling = _axis_ceiling(max(totals, default=0))
    slot = (right - left) / max(len(categories), 1)
    gap = min(slot * 0.2, 4.0)
    bars = []
    for index, category in enumerate(categories):
        base = 0
        for layer in series:
            value = layer.values[index]
            if value > 0:
                y_top, y_base = (
                    _y(base + value, ceiling, top, bottom),
                    _y(base, ceiling, top, bottom),
                )
                bars.append(
                    Bar(
                        x=round(left + index * slot + gap / 2, 2),
                        y=round(y_top, 2),
                        width=round(slot - gap, 2),
                        height=round(max(y_base - y_top, 0.5), 2),
                        css_class=layer.css_class,
                        series=layer.name,
                        value=value,
                        title=f"{category}: {layer.label} {value:,}",
                    )
                )
            base += value
    y_ticks = tuple(
        Tick(
            round(_y(ceiling * step / Y_TICKS, ceiling, top, bottom), 2),
            compact_number(ceiling * step / Y_TICKS),
        )
        for step in range(Y_TICKS + 1)
    )
    short = tick_labels if tick_labels is not None else categories
    x_ticks = tuple(
        Tick(round(left + (index + 0.5) * slot, 2), short[index])
        for index in range(len(categories))
        if index % label_every == 0
    )
    rows = tuple(
        Row(category, tuple(layer.values[index] for layer in series))
        for index, category in enumerate(categories)
    )
    return Chart(
        identifier=identifier,
        title=title,
        description=description,
        width=width,
        height=height,
        left=left,
        top=top,
        right=right,
        bottom=bottom,
        x_axis_label=x_axis_label,
        y_axis_label=y_axis_label,
        bars=tuple(bars),
        y_ticks=y_ticks,
        x_ticks=x_ticks,
        series=tuple(series),
        rows=rows,
    )


def _axis_ceiling(largest: int) -> int:
    # Y_TICKS round steps: every tick is a round number.
    return nice_ceiling(largest / Y_TICKS) * Y_TICKS


def _y(value: float, ceiling: int, top: float, bottom: float) -> float:
    return bottom - (bottom - top) * value / ceiling
