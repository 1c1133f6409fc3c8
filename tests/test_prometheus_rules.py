"""The shipped alert rules and Grafana dashboard are valid and read real metrics.

- ``promtool check rules`` accepts docs/prometheus/alerts.yml, and ``promtool
  test rules`` passes its unit tests (docs/prometheus/alerts_test.yml), in
  which every alert is shown firing and not firing;
- every alert has a ``for:``, a severity and a summary and description
  whose links name pages (and sections) that exist in docs/;
- the dashboard (docs/grafana/django-idempotency.json) is valid JSON on the
  ``${DS_PROMETHEUS}`` datasource variable, with the database and operation
  variables, and promtool parses each of its queries;
- every metric name the rules and the dashboard read, and every label
  they select or group by, is one the package defines.

promtool comes with Debian's ``prometheus`` package; without it these tests
skip, or fail with ``IDEMPOTENCY_REQUIRE_SERVICES=1`` (CI).
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from django_idempotency.models import IdempotencyRecord
from tests.live.prometheus_docs import (
    ALERT_RULES,
    ALERT_TESTS,
    alert_rules,
    dashboard,
    dashboard_panels,
    dashboard_queries,
    load_yaml,
    metric_names,
)
from tests.live.prometheus_server import require_binary
from tests.live.server import REPO_ROOT

DOCS = REPO_ROOT / "docs"


def promtool(*args: str, cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [require_binary("promtool"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


# -- the rules ----------------------------------------------------------------------------


def test_promtool_accepts_the_alert_rules() -> None:
    result = promtool("check", "rules", str(ALERT_RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in result.stdout


def test_the_alert_rules_unit_tests_pass() -> None:
    result = promtool("test", "rules", ALERT_TESTS.name, cwd=ALERT_TESTS.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_is_tested_firing_and_not_firing() -> None:
    fired: set[str] = set()
    silent: set[str] = set()
    for case in load_yaml(ALERT_TESTS)["tests"]:
        for check in case.get("alert_rule_test", []):
            (fired if check.get("exp_alerts") else silent).add(check["alertname"])
    alerts = {rule["alert"] for rule in alert_rules()}
    assert alerts - fired == set(), "alerts never shown firing"
    assert alerts - silent == set(), "alerts never shown not firing"
    assert (fired | silent) - alerts == set(), "tests of alerts that do not exist"


def test_every_alert_waits_has_a_severity_and_says_what_to_do() -> None:
    for rule in alert_rules():
        assert rule["group"] == "django-idempotency"
        name = rule["alert"]
        assert re.fullmatch(r"Idempotency[A-Z]\w+", name), name
        assert rule.get("for"), f"{name} has no `for:`"
        assert rule["labels"]["severity"] in {"warning", "critical"}, name
        assert set(rule["annotations"]) >= {"summary", "description"}, name
        assert re.search(r"\b[\w-]+\.md\b", rule["annotations"]["description"]), (
            f"{name}'s description links no documentation page"
        )


def _anchors(page: Path) -> set[str]:
    """A page's section ids: explicit ``{ #id }`` and MkDocs' slugs of its headings."""
    text = page.read_text()
    anchors = set(re.findall(r"\{\s*#([\w-]+)\s*\}", text))
    for heading in re.findall(r"^#+ (.+?)(?:\s*\{[^}]*\})?$", text, re.M):
        slug = re.sub(r"[^\w\s-]", "", heading.lower()).strip()
        anchors.add(re.sub(r"[\s]+", "-", slug))
    return anchors


def test_the_alerts_links_name_existing_pages_and_sections() -> None:
    links = {
        match
        for rule in alert_rules()
        for text in rule["annotations"].values()
        for match in re.findall(r"\b([\w-]+\.md(?:#[\w-]+)?)", text)
    }
    assert links
    for link in sorted(links):
        name, _, anchor = link.partition("#")
        page = DOCS / name
        assert page.is_file(), f"{link}: no page docs/{name}"
        if anchor:
            assert anchor in _anchors(page), f"{link}: no such section in docs/{name}"


# -- the dashboard ------------------------------------------------------------------------


def test_the_dashboard_is_grafana_json_on_a_prometheus_datasource_variable() -> None:
    board = dashboard()
    assert board["schemaVersion"] >= 39
    variables = {variable["name"]: variable for variable in board["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    for name, metric in (
        ("database", "idempotency_records"),
        ("operation", "idempotency_requests_total"),
    ):
        assert variables[name]["type"] == "query"
        assert variables[name]["definition"] == f"label_values({metric}, {name})"
        assert variables[name]["datasource"]["uid"] == "${DS_PROMETHEUS}"
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for panel in dashboard_panels():
        assert panel["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, panel
        assert panel["targets"] and all(target["expr"] for target in panel["targets"]), panel
        assert all(target["datasource"]["uid"] == "${DS_PROMETHEUS}" for target in panel["targets"])


def test_the_dashboard_draws_what_the_issue_asks() -> None:
    titles = {panel["title"] for panel in dashboard_panels()}
    assert titles >= {
        "Request outcomes",
        "Replay ratio",
        "Refusals: 409, 422, 503",
        "Protection duration",
        "Records by state",
        "Oldest unresolved record by state",
        "Purge backlog",
        "Recovery outcomes",
        "Purged",
        "Census age",
    }


def test_promtool_parses_every_dashboard_query(tmp_path: Path) -> None:
    """Each query as a recording rule: ``promtool check rules`` parses its PromQL."""
    queries = dashboard_queries()
    assert not [query for query in queries if "$" in query], "Grafana variables left"
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:query_{index}", "expr": query}
                    for index, query in enumerate(queries)
                ],
            }
        ]
    }
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump(rules))
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(queries)} rules found" in result.stdout


# -- metric names -------------------------------------------------------------------------

#: Run in a process of its own, so that its values stay out of this
#: process's registry (other tests read theirs): every instrument of the
#: Prometheus sink given one value, recovery's and the purge's real calls
#: made, and the default registry scraped.
_SCRAPE = """
import django, json, sys
django.setup()
import prometheus_client
from prometheus_client.parser import text_string_to_metric_families
from django_idempotency import metrics
from django_idempotency._observability import recording
from django_idempotency._observability.prometheus import prometheus_sink
from django_idempotency.recovery import RecoveryReport

sink = prometheus_sink()
for instrument in metrics.INSTRUMENTS:
    labels = {name: "probe" for name in instrument.labels}
    method = {"counter": sink.add, "histogram": sink.record, "gauge": sink.set}[instrument.kind]
    method(instrument, 1, labels)
names = [field for field in vars(RecoveryReport()) if not field.startswith("_")]
recording.count_recovery(RecoveryReport(**{name: 1 for name in names}))
recording.count_purged("probe", deleted=1, tombstoned=1)
families = text_string_to_metric_families(prometheus_client.generate_latest().decode())
json.dump(
    [
        {"help": family.documentation, "samples": [[s.name, s.labels] for s in family.samples]}
        for family in families
        if family.name.startswith("idempotency_")
    ],
    sys.stdout,
)
"""


@dataclass(frozen=True)
class Exposed:
    """What the package's Prometheus sink exposes."""

    #: Series name -> the label names it carries.
    labels: dict[str, set[str]]
    #: (series name, label) -> the values the package gives that label.
    values: dict[tuple[str, str], set[str]]


@functools.cache
def exposed() -> Exposed:
    env = {name: value for name, value in os.environ.items() if name != "PROMETHEUS_MULTIPROC_DIR"}
    env["DJANGO_SETTINGS_MODULE"] = "tests.live.prometheus_settings"
    result = subprocess.run(
        [sys.executable, "-c", _SCRAPE],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    labels: dict[str, set[str]] = {}
    values: dict[tuple[str, str], set[str]] = {}
    for family in json.loads(result.stdout):
        for name, sample_labels in family["samples"]:
            labels.setdefault(name, set()).update(sample_labels)
            for label, value in sample_labels.items():
                if value != "probe":  # the real calls' values
                    values.setdefault((name, label), set()).add(value)
        # The request outcomes, as the metric's help lists them to operators.
        listed = re.search(r"by outcome: ([a-z_, ]+)\.", family["help"])
        if listed and family["samples"]:
            outcomes = {value.strip() for value in listed[1].split(",")}
            for name, _ in family["samples"]:
                values.setdefault((name, "outcome"), set()).update(outcomes)
    for name in labels:
        if "state" in labels[name]:
            values[(name, "state")] = set(IdempotencyRecord.State.values)
    return Exposed(labels, values)


def test_the_package_exposes_the_metrics_of_the_design() -> None:
    """The scrape above sees what it should, or the checks below would prove little."""
    series = exposed().labels
    assert series["idempotency_requests_total"] >= {"operation", "outcome"}
    assert series["idempotency_protection_duration_seconds_bucket"] >= {"operation", "le"}
    assert series["idempotency_census_timestamp_seconds"] == {"database"}
    assert {"replayed", "store_unavailable", "key_reused"} <= exposed().values[
        ("idempotency_requests_total", "outcome")
    ]
    assert exposed().values[("idempotency_purged_total", "action")] == {"deleted", "tombstoned"}


def _expressions() -> list[tuple[str, str]]:
    rules = [(f"alert {rule['alert']}", str(rule["expr"])) for rule in alert_rules()]
    panels = [
        (f"panel {panel['title']!r}", str(target["expr"]))
        for panel in dashboard_panels()
        for target in panel["targets"]
    ]
    variables = [
        (f"variable {variable['name']}", str(variable["definition"]))
        for variable in dashboard()["templating"]["list"]
        if variable["type"] == "query"
    ]
    return rules + panels + variables


def test_rules_and_dashboard_read_only_metrics_the_package_defines() -> None:
    defined = exposed().labels
    used: set[str] = set()
    for where, expr in _expressions():
        names = metric_names(expr)
        assert names, f"{where} reads no idempotency metric: {expr}"
        unknown = names - set(defined)
        assert not unknown, f"{where} reads {sorted(unknown)}, not defined: {expr}"
        used |= names
    # The dashboard shows them all (the histogram's _count and _sum, and
    # the counters' _created, aside).
    assert {name for name in defined if not name.endswith(("_count", "_sum", "_created"))} <= used


_SELECTOR = re.compile(r"\b(idempotency_[a-z_]+)\s*\{([^}]*)\}")
_MATCHER = re.compile(r"(\w+)\s*(=~|!~|!=|=)\s*\"([^\"]*)\"")
_GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
#: Prometheus adds these to every series it scrapes.
_TARGET_LABELS = {"job", "instance"}


def test_rules_and_dashboard_select_and_group_by_labels_the_metrics_carry() -> None:
    defined = exposed()
    for where, expr in _expressions():
        carried = set().union(*(defined.labels[name] for name in metric_names(expr)))
        for metric, matchers in _SELECTOR.findall(expr):
            for label, operator, value in _MATCHER.findall(matchers):
                assert label in defined.labels[metric] | _TARGET_LABELS, (
                    f"{where}: {metric} has no label {label}"
                )
                known = defined.values.get((metric, label))
                if known is None or value.startswith("$"):
                    continue  # free values (operation, database), or Grafana's
                wanted = set(value.split("|")) if operator == "=~" else {value}
                assert wanted <= known, (
                    f"{where}: {metric}{{{label}}} is never {sorted(wanted - known)} "
                    f"(the package gives {sorted(known)})"
                )
        for grouping in _GROUPING.findall(expr):
            names = {name.strip() for name in grouping.split(",") if name.strip()}
            assert names <= carried | _TARGET_LABELS, f"{where} groups by {names - carried}"
