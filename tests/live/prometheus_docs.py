"""What the shipped Prometheus rules and Grafana dashboard contain, for the tests.

docs/prometheus/alerts.yml (and its promtool tests, alerts_test.yml) and
docs/grafana/django-idempotency.json, read as data: the rules, the
dashboard's queries with Grafana's variables filled in, and the metric
names a PromQL expression reads.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from tests.live.server import REPO_ROOT

ALERT_RULES = REPO_ROOT / "docs" / "prometheus" / "alerts.yml"
ALERT_TESTS = REPO_ROOT / "docs" / "prometheus" / "alerts_test.yml"
DASHBOARD = REPO_ROOT / "docs" / "grafana" / "django-idempotency.json"

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_METRIC = re.compile(r"\bidempotency_[a-z_]+\b")


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def alert_rules() -> list[dict[str, Any]]:
    """Every rule of alerts.yml, with its group's name under ``group``."""
    return [
        {**rule, "group": group["name"]}
        for group in load_yaml(ALERT_RULES)["groups"]
        for rule in group["rules"]
    ]


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def dashboard_panels() -> list[dict[str, Any]]:
    """The panels that draw something (rows excluded)."""
    return [panel for panel in dashboard()["panels"] if panel["type"] != "row"]


def dashboard_queries(rate_interval: str = "5m") -> list[str]:
    """Every panel's PromQL, Grafana's variables replaced as Grafana would (all values)."""
    replacements = {
        "$__rate_interval": rate_interval,
        "$__range": "1h",
        "$database": ".*",
        "$operation": ".*",
    }
    queries = []
    for panel in dashboard_panels():
        for target in panel["targets"]:
            expr = str(target["expr"])
            for variable, value in replacements.items():
                expr = expr.replace(variable, value)
            queries.append(expr)
    return queries


def metric_names(expr: str) -> set[str]:
    """The ``idempotency_*`` series names a PromQL expression reads (not inside strings)."""
    return set(_METRIC.findall(_STRING.sub('""', expr)))
