"""The reference pages say what the code does.

Every fact checked here is read from the code (the settings' defaults, the
refusals' codes and statuses, the system checks' ids, the commands'
options, the Celery tasks' signatures, the model's permissions and fields,
the signals), never from a list copied into this file, so that a change on
either side without the other fails here.
"""

from __future__ import annotations

import ast
import inspect
import re
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.core.management import find_commands, load_command_class
from django.core.management.base import BaseCommand
from django.dispatch import Signal
from django.test import override_settings
from django.urls import path
from drf_spectacular.generators import SchemaGenerator
from rest_framework import generics, serializers
from rest_framework.response import Response

import django_idempotency.management
from django_idempotency import checks, exceptions, idempotent, signals, tasks
from django_idempotency.conf import DEFAULTS, SETTINGS
from django_idempotency.drf import IdempotentMixin
from django_idempotency.models import IdempotencyRecord

REPO_ROOT = Path(__file__).resolve().parent.parent
DOCS = REPO_ROOT / "docs"


def page(name: str) -> str:
    return (REPO_ROOT / name).read_text() if name == "README.md" else (DOCS / name).read_text()


def section(text: str, heading: str) -> str:
    """The text under the heading line ``## <heading>``, up to the next such heading."""
    match = re.search(rf"^## {re.escape(heading)}$(?P<body>.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match is not None, f"no section {heading!r}"
    return match["body"]


def table_rows(text: str) -> Iterator[list[str]]:
    """The cells of each Markdown table row in ``text``, the header row included."""
    for line in text.splitlines():
        if line.startswith("|") and line.rstrip().endswith("|"):
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            if not all(re.fullmatch(r":?-+:?", cell) for cell in cells):
                yield cells


def code_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}[^\n]*\n(.*?)^```", text, re.M | re.S)


# Settings


def documented_default(value: Any) -> str:
    """How settings.md spells a default: ``24 hours``, ```"drf"```, ```True```."""
    if isinstance(value, timedelta):
        seconds = int(value.total_seconds())
        for unit, size in (("hour", 3600), ("minute", 60), ("second", 1)):
            if seconds % size == 0:
                count = seconds // size
                return f"{count} {unit}{'' if count == 1 else 's'}"
    if isinstance(value, str):
        return f'`"{value}"`'
    return f"`{value!r}`"


def settings_table() -> dict[str, list[str]]:
    rows = {}
    for cells in table_rows(page("settings.md")):
        match = re.fullmatch(r"`([A-Z_]+)`", cells[0])
        if match and len(cells) == 4:
            rows[match[1]] = cells
    return rows


def test_the_settings_table_lists_every_setting_and_no_other() -> None:
    assert set(settings_table()) == set(DEFAULTS)


@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_the_settings_table_gives_each_default_as_the_code_has_it(name: str) -> None:
    default_cell = settings_table()[name][1]
    assert default_cell.startswith(documented_default(DEFAULTS[name])), default_cell


def test_the_settings_example_spells_out_exactly_the_defaults() -> None:
    example = code_blocks(page("settings.md"), "python")[0]
    namespace: dict[str, Any] = {}
    exec(example, namespace)  # the page's own code: from datetime import timedelta ...
    assert namespace["IDEMPOTENCY"] == dict(DEFAULTS)


def test_the_readme_settings_example_gives_the_defaults() -> None:
    settings_section = section(page("README.md"), "Settings")
    namespace: dict[str, Any] = {"timedelta": timedelta}
    exec(code_blocks(settings_section, "python")[0], namespace)
    shown = namespace["IDEMPOTENCY"]
    assert shown == {name: DEFAULTS[name] for name in shown}


def check_ids(**idempotency: Any) -> set[str]:
    with override_settings(IDEMPOTENCY=idempotency):
        return {message.id for message in checks.check_settings() if message.id}


@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_the_settings_table_names_the_check_of_each_setting(name: str) -> None:
    # No setting accepts a bare object(): each one's own check reports it.
    reported = check_ids(**{name: object()}) - check_ids()
    listed = {
        f"django_idempotency.{number}"
        for number in re.findall(r"[EW]\d{3}", settings_table()[name][3])
    }
    assert reported
    assert reported <= listed


def test_the_readme_lists_every_argument_of_idempotent_and_the_mixin() -> None:
    rows = table_rows(section(page("README.md"), "Protecting views"))
    documented = {cells[0].strip("`") for cells in rows} - {"argument"}
    arguments = {
        name
        for name, parameter in inspect.signature(idempotent).parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY
    }
    assert documented == arguments
    # "class attributes idempotency_<name> on the mixin"
    assert all(hasattr(IdempotentMixin, f"idempotency_{name}") for name in arguments)


# System checks


def ids_in_checks_module() -> set[str]:
    """Every check id the check modules can emit: ``error(N, ...)``, literals, and the
    generic checks of the booleans and durations that conf.py declares."""
    package = Path(inspect.getfile(checks)).parent
    ids = {
        f"django_idempotency.{setting.checks[0]}"
        for setting in SETTINGS
        if setting.kind is not None
    }
    for module in [package / "_view_checks.py", *package.glob("**/checks.py")]:
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                ids.update(re.findall(r"django_idempotency\.[EW]\d{3}", node.value))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                number = node.args[0] if node.func.id == "error" and node.args else None
                if isinstance(number, ast.Constant) and isinstance(number.value, int):
                    ids.add(f"django_idempotency.E{number.value:03d}")
    return ids


def test_every_system_check_id_is_documented_and_no_other() -> None:
    documented = {
        match[1]
        for cells in table_rows(page("checks.md"))
        if (match := re.fullmatch(r"`(django_idempotency\.[EW]\d{3})`", cells[0]))
    }
    in_code = ids_in_checks_module()
    # The reading of the modules found them: the shared, a store and a view check.
    assert {
        "django_idempotency.E001",
        "django_idempotency.E032",
        "django_idempotency.E036",
    } <= in_code
    assert documented == in_code


# Errors


def refusals() -> list[type[exceptions.IdempotencyRefusal]]:
    return [
        value
        for value in vars(exceptions).values()
        if isinstance(value, type)
        and issubclass(value, exceptions.IdempotencyRefusal)
        and value is not exceptions.IdempotencyRefusal
    ]


@pytest.mark.parametrize("refusal", refusals(), ids=lambda refusal: refusal.__name__)
def test_every_refusal_code_has_its_section_with_its_status(
    refusal: type[exceptions.IdempotencyRefusal],
) -> None:
    text = section(page("errors.md"), f"{refusal.default_code} {{ #{refusal.default_code} }}")
    first_paragraph = text.strip().split("\n\n")[0]
    assert first_paragraph.startswith(f"**{refusal.status_code}**"), first_paragraph
    assert f"`{refusal.__name__}`" in first_paragraph


def test_every_section_of_the_errors_page_is_a_code_the_package_answers() -> None:
    documented = set(re.findall(r"^## (\w+) \{ #\1 \}", page("errors.md"), re.M))
    assert documented == {refusal.default_code for refusal in refusals()}


@pytest.mark.parametrize("refusal", refusals(), ids=lambda refusal: refusal.__name__)
def test_the_behaviour_table_answers_each_code_with_its_status(
    refusal: type[exceptions.IdempotencyRefusal],
) -> None:
    rows = [
        cells
        for cells in table_rows(section(page("http.md"), "The behaviour table"))
        if f"`{refusal.default_code}`" in cells[-1]
    ]
    assert rows, refusal.default_code
    assert all(cells[1] == str(refusal.status_code) for cells in rows), rows


# OpenAPI


class Amount(serializers.Serializer[Any]):
    amount = serializers.IntegerField()


class UnprotectedView(generics.GenericAPIView[Any]):
    serializer_class = Amount

    def post(self, request: Any) -> Response:
        return Response(status=201)


class ProtectedView(UnprotectedView):
    @idempotent
    def post(self, request: Any) -> Response:
        return Response(status=201)


def statuses_the_schema_adds() -> set[int]:
    unprotected, protected = UnprotectedView.as_view(), ProtectedView.as_view()
    generator = SchemaGenerator(  # type: ignore[no-untyped-call]
        patterns=[path("unprotected", unprotected), path("protected", protected)]
    )
    schema = generator.get_schema(request=None, public=True)  # type: ignore[no-untyped-call]
    responses = {
        name: set(schema["paths"][f"/{name}"]["post"]["responses"])
        for name in ("unprotected", "protected")
    }
    return {int(status) for status in responses["protected"] - responses["unprotected"]}


def test_the_openapi_page_lists_the_statuses_the_schema_adds() -> None:
    listed = re.search(r"^- the responses ([\d, and]+), unless", page("openapi.md"), re.M)
    assert listed is not None
    statuses = {int(status) for status in re.findall(r"\d{3}", listed[1])}
    assert statuses == statuses_the_schema_adds()


def test_the_comparison_lists_the_statuses_the_schema_adds() -> None:
    cell = re.search(r"drf-spectacular: header, ([\d, ]+) \|", page("comparison.md"))
    assert cell is not None
    assert {int(status) for status in cell[1].split(", ")} == statuses_the_schema_adds()


# Management commands


def command_names() -> list[str]:
    return find_commands(str(Path(inspect.getfile(django_idempotency.management)).parent))


def own_options(name: str) -> dict[str, Any]:
    """``{"--batch-size": 100, ...}``: the options the command adds to Django's own."""
    command = load_command_class("django_idempotency", name)
    base = {action.dest for action in BaseCommand().create_parser("manage.py", name)._actions}
    return {
        max(action.option_strings, key=len): action.default
        for action in command.create_parser("manage.py", name)._actions
        if action.dest not in base
    }


def documented_option_default(value: Any, option: str = "") -> str:
    if value is None:
        return "every records database" if option == "--database" else "no limit"
    if value is False:
        return "off"
    return f"`{value:g}`" if isinstance(value, float) else f"`{value}`"


def test_every_command_has_its_section_and_no_other() -> None:
    documented = set(re.findall(r"^## (idempotency_\w+)$", page("commands.md"), re.M))
    assert documented == set(command_names())


@pytest.mark.parametrize("name", command_names())
def test_the_commands_page_gives_each_option_with_its_default(name: str) -> None:
    text = section(page("commands.md"), name)
    usage = code_blocks(text, "text")[0]
    rows = {cells[0].split()[0].strip("`"): cells for cells in table_rows(text)}
    options = own_options(name)
    assert options
    for option, default in options.items():
        assert option in usage, option
        assert rows[option][1] == documented_option_default(default, option), (option, rows[option])
    documented = {option for option in rows if option.startswith("--")}
    assert documented == set(options)


# Celery tasks


def scheduled_tasks() -> dict[str, Any]:
    return {
        entry["task"].rsplit(".", 1)[1]: getattr(tasks, entry["task"].rsplit(".", 1)[1])
        for entry in tasks.BEAT_SCHEDULE.values()
    }


def keyword_defaults(task: Any) -> dict[str, Any]:
    return {
        name: parameter.default
        for name, parameter in inspect.signature(task.run).parameters.items()
        if parameter.default is not inspect.Parameter.empty
    }


@pytest.mark.parametrize("name", sorted(scheduled_tasks()))
def test_the_beat_page_gives_each_tasks_keyword_defaults(name: str) -> None:
    shown = re.search(rf"`{name}\((.*?)\)`", page("celery-beat.md"), re.S)
    assert shown is not None, name
    call = ast.parse(f"f({' '.join(shown[1].split())})", mode="eval").body
    assert isinstance(call, ast.Call)
    documented = {keyword.arg: ast.literal_eval(keyword.value) for keyword in call.keywords}
    assert documented == keyword_defaults(scheduled_tasks()[name])


def test_the_pages_give_the_purge_tasks_bound_per_run() -> None:
    defaults = keyword_defaults(tasks.purge_expired_records)
    per_run = defaults["batch_size"] * defaults["max_batches"]
    assert f"({per_run:,} with the defaults of the task" in page("celery-beat.md")
    max_batches_row = next(
        cells
        for cells in table_rows(section(page("commands.md"), "idempotency_purge"))
        if cells[0].startswith("`--max-batches")
    )
    assert f"the Celery task's default is {defaults['max_batches']:,}" in max_batches_row[2]


# The model, the admin and the signals


@pytest.mark.parametrize("document", ["admin.md", "states.md"])
def test_every_permission_of_the_model_is_listed(document: str) -> None:
    text = page(document)
    for codename, _ in IdempotencyRecord._meta.permissions:
        assert f"`{codename}`" in text, codename


def test_the_fields_table_lists_every_field_of_the_record() -> None:
    text = section(page("states.md"), "Fields")
    documented = set(re.findall(r"`(\w+)`", "".join(cells[0] for cells in table_rows(text))))
    fields = {field.name for field in IdempotencyRecord._meta.concrete_fields} - {"id"}
    assert documented == fields


def test_the_states_page_names_every_index_and_constraint_of_the_record() -> None:
    text = section(page("states.md"), "Fields")
    meta = IdempotencyRecord._meta
    for name in [index.name for index in meta.indexes] + [c.name for c in meta.constraints]:
        assert f"`{name}`" in text, name


def test_the_states_table_lists_every_state() -> None:
    text = section(page("states.md"), "States")
    documented = {cells[0].strip("`") for cells in table_rows(text)} - {"state"}
    assert documented == set(IdempotencyRecord.State.values)


def test_every_signal_is_documented_and_no_other() -> None:
    sent = {name for name, value in vars(signals).items() if isinstance(value, Signal)}
    documented = {
        cells[0].strip("`") for cells in table_rows(page("signals.md")) if cells[0] != "signal"
    }
    assert documented == sent


# The pages that list what the package sets on the server.
#
# The package sets two settings transaction-locally: the takeover's
# ``lock_timeout`` (_store/conditional.py) and recovery's
# ``idle_in_transaction_session_timeout`` (_store/maintenance.py). The pages
# that tell an operator what the package sets must name both:
#
# - docs/pgbouncer.md once named ``lock_timeout`` alone, "for the
#   ``single_transaction`` claim"; a pooler or an audit that watches GUC
#   changes meets both.
# - docs/settings.md's ``IN_FLIGHT_WAIT`` row once named only the wait mode
#   and the single-transaction and optimistic claims, not the takeover's
#   bound on a locked row (a retry's 409 after IN_FLIGHT_WAIT) nor
#   recovery's idle-in-transaction bound.
#
# The settings are read from the code (every ``set_config('<name>'`` and
# ``wait_bounds.at_most('<name>')`` in the package), not copied here.

PACKAGE = REPO_ROOT / "django_idempotency"


def _settings_the_package_sets() -> set[str]:
    found: set[str] = set()
    for source in PACKAGE.rglob("*.py"):
        text = source.read_text()
        found |= set(re.findall(r"(?:set_config|at_most)\('([a-z_]+)'", text))
    return found


def test_the_pgbouncer_page_names_every_setting_the_package_sets() -> None:
    page = (DOCS / "pgbouncer.md").read_text()
    assert _settings_the_package_sets() >= {"lock_timeout", "idle_in_transaction_session_timeout"}
    missing = {name for name in _settings_the_package_sets() if name not in page}
    assert not missing, f"docs/pgbouncer.md does not name {sorted(missing)}"
    assert "The only setting it changes is `lock_timeout`" not in page


def test_the_in_flight_wait_row_says_what_it_bounds() -> None:
    (row,) = [
        line
        for line in (DOCS / "settings.md").read_text().splitlines()
        if line.startswith("| `IN_FLIGHT_WAIT`")
    ]
    assert "takeover" in row or "taken over" in row, row
    assert "recovery" in row, row


# docs/observability.md against the code.


def test_the_cost_section_gives_the_measured_cost_per_request() -> None:
    """The page ends with an empty "## Cost" heading.

    An operator deciding whether to turn the metrics (and spans) on needs
    their measured cost per request, as a ratio, from the benchmarks.
    """
    cost = section(page("observability.md"), "Cost")
    assert cost.strip(), "empty section"
    assert re.search(r"\d", cost), "no figure"


#: What a user cannot look up: an internal issue's number, a commit.
INTERNAL_REFERENCE = re.compile(
    r"\bissue ?#?[0-9]+|\bcommits? `?[0-9a-f]{7,40}\b|`(?=[0-9]*[a-f])[0-9a-f]{7,40}`",
    re.IGNORECASE,
)


def test_the_docs_and_the_changelog_cite_no_issue_numbers_or_commits() -> None:
    pages = [*sorted(DOCS.rglob("*.md")), REPO_ROOT / "CHANGELOG.md", REPO_ROOT / "README.md"]
    cited = [
        f"{page.relative_to(REPO_ROOT)}:{number}: {line.strip()}"
        for page in pages
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
        if INTERNAL_REFERENCE.search(line)
    ]
    assert not cited, "\n".join(cited)


def test_the_docs_say_how_to_get_the_demo_wherever_they_show_its_files() -> None:
    # Files of the demo project are in the repository, not the wheel: a page
    # that points at one links to the page that says how to get them.
    for page in sorted(DOCS.rglob("*.md")):
        text = page.read_text(encoding="utf-8")
        if "testproject/" in text and page.name != "index.md":
            assert "index.md#the-demo-and-the-repository" in text, page.name
    index = (DOCS / "index.md").read_text(encoding="utf-8")
    assert "git clone" in index and "make demo" in index


def test_every_state_request_in_flight_is_sent_with_is_documented() -> None:
    """A signal's arguments are public: each ``state`` the code sends is in its row.

    Besides the record's own states and "unknown": the literal states the
    request path writes, read from the code (``in_flight(..., state="...")``
    and ``in_flight_state = "..."``).
    """
    source = "\n".join(
        path.read_text() for path in (REPO_ROOT / "django_idempotency" / "_protection").glob("*.py")
    )
    sent = set(re.findall(r'in_flight\([^)]*state="([^"]+)"', source))
    sent |= set(re.findall(r'in_flight_state = "([^"]+)"', source))
    [row] = [
        line
        for line in (DOCS / "signals.md").read_text().splitlines()
        if line.startswith("| `request_in_flight` |")
    ]
    assert sent >= {"contended", "taken over"}  # the search still finds them
    assert {state for state in sent if f'`"{state}"`' not in row} == set()


def test_every_reason_a_request_releases_or_leaves_uncertain_with_is_documented() -> None:
    """``claim_released`` and ``record_uncertain``: each literal ``reason`` the request
    path gives (a failed view's is either, depending on ``begin_external()``) is in
    both rows; the other reasons are status codes."""
    source = "\n".join(
        path.read_text() for path in (REPO_ROOT / "django_idempotency" / "_protection").glob("*.py")
    )
    given = set(re.findall(r'reason="([^"]+)"', source))
    given |= set(re.findall(r'reason = "([^"]+)"', source))
    given |= set(re.findall(r'reason = "[^"]+" if .* else "([^"]+)"', source))
    assert given >= {"exception", "store unavailable"}  # the search still finds them
    page = (DOCS / "signals.md").read_text().splitlines()
    for signal in ("claim_released", "record_uncertain"):
        [row] = [line for line in page if line.startswith(f"| `{signal}` |")]
        assert {reason for reason in given if f'`"{reason}"`' not in row} == set(), signal


# docs/clients.md: the recipe it shows is the one the tests run.

EXAMPLES = DOCS / "examples"
TITLED_PYTHON = re.compile(r'^```python title="(?P<name>[^"]+)"\n(?P<body>.*?)^```$', re.M | re.S)


def test_the_clients_page_shows_each_recipe_file_exactly() -> None:
    """tests/test_client_recipe.py and tests/live/test_client_recipe_live.py run
    docs/examples/; the page shows each of those files whole, and no other code
    under a file name."""
    shown = {match["name"]: match["body"] for match in TITLED_PYTHON.finditer(page("clients.md"))}
    files = {path.name: path.read_text() for path in sorted(EXAMPLES.glob("*.py"))}
    assert set(files) == {"idempotent_client.py", "idempotent_client_requests.py"}
    assert shown == files


@pytest.mark.parametrize("refusal", refusals(), ids=lambda refusal: refusal.__name__)
def test_the_clients_page_says_what_to_do_with_each_refusal(
    refusal: type[exceptions.IdempotencyRefusal],
) -> None:
    assert f"`{refusal.default_code}`" in page("clients.md")
