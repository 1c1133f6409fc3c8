"""Review of issue 17: docs/observability.md against the issue and the code."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"


def section(page: str, heading: str) -> str:
    text = (DOCS / page).read_text()
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match is not None, f"no '## {heading}' in {page}"
    return match.group(1)


def test_the_cost_section_gives_the_measured_cost_per_request() -> None:
    """The page ends with an empty "## Cost" heading.

    Issue 17's "Done when" asks for the measured cost per request of having
    the metrics (and spans) on, as a ratio, from the benchmarks.
    """
    cost = section("observability.md", "Cost")
    assert cost.strip(), "empty section"
    assert re.search(r"\d", cost), "no figure"
