"""The public API: a rename or a refactoring cannot remove a public name unnoticed.

Three nets:

- every import path the documentation shows (``from django_idempotency...
  import ...`` statements and dotted ``django_idempotency.x.y`` paths in
  README.md and docs/*.md, read from the text, so a newly documented path
  is covered without editing this file) still imports;
- the names SPEC's "Public contract" fixes exist and mean what it says;
- their shapes (parameter names, kinds and defaults of the public callables,
  the model's fields, the settings' defaults, the commands' options) match
  the recorded snapshot ``tests/public_api.txt``.

A deliberate change of the public API (a name added, a keyword renamed with
its deprecation): rerun this module with ``IDEMPOTENCY_UPDATE_API_SNAPSHOT=1``,
review the diff of ``tests/public_api.txt``, commit it and say so in
CHANGELOG.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import enum
import importlib
import inspect
import json
import os
import re
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.core.management import get_commands, load_command_class
from django.core.management.base import BaseCommand
from django.db import models
from django.dispatch import Signal
from rest_framework.decorators import api_view
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.test import APIRequestFactory

from django_idempotency import idempotent
from tests.utils import SPEC_CONTEXT_ATTRIBUTES, SPEC_CONTEXT_METHODS, SPEC_PATHS

ROOT = Path(__file__).resolve().parent.parent
SNAPSHOT = Path(__file__).resolve().parent / "public_api.txt"
UPDATE_VARIABLE = "IDEMPOTENCY_UPDATE_API_SNAPSHOT"
HOW_TO_UPDATE = (
    f"The public API differs from the snapshot {SNAPSHOT.relative_to(ROOT)} (diff below: "
    "'-' recorded, '+' now). If a public name was removed or a keyword renamed by "
    "accident, restore it (keep the old one importable where it is documented). If the "
    f"change is deliberate, rerun this test with {UPDATE_VARIABLE}=1, review "
    "and commit the new snapshot, and say so in CHANGELOG.md."
)

# -- what the documentation shows -----------------------------------------------------

DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FROM_IMPORT = re.compile(
    r"^[ \t>]*from[ \t]+(django_idempotency(?:\.\w+)*)[ \t]+import[ \t]+(\([^)]*\)|[^\n]*)",
    re.MULTILINE,
)
_DOTTED = re.compile(r"\bdjango_idempotency(?:\.\w+)+")
# Dotted strings in the docs that are not import paths: system check ids
# ("django_idempotency.E001") and permissions ("<app_label>.<codename>").
_NOT_AN_IMPORT_PATH = re.compile(r"^django_idempotency\.(?:[EW]\d{3}|\w+_idempotencyrecord)$")


def documented_paths() -> dict[str, list[str]]:
    """Every import path README.md and docs/*.md show, with the files showing it."""
    found: dict[str, set[str]] = {}

    def add(path: str, document: Path) -> None:
        if not _NOT_AN_IMPORT_PATH.match(path):
            found.setdefault(path, set()).add(str(document.relative_to(ROOT)))

    for document in DOCUMENTS:
        text = document.read_text(encoding="utf-8")
        for module, names in _FROM_IMPORT.findall(text):
            add(module, document)
            for line in names.strip("()").splitlines():
                for name in line.split("#", 1)[0].split(","):
                    name = name.split(" as ", 1)[0].strip()
                    if name and name != "*":
                        add(f"{module}.{name}", document)
        for path in _DOTTED.findall(text):
            add(path, document)
        for path in _names_under_headings(text):
            add(path, document)
        for path in _mkdocstrings_members(text):
            add(path, document)
    return {path: sorted(documents) for path, documents in sorted(found.items())}


_HEADING = re.compile(r"^(#+)\s+(.*)$")
_MODULE_HEADING = re.compile(r"^`(django_idempotency(?:\.\w+)*)`$")
# A line opening with backticked names: "`Completed(status=200, ...)`" or
# "`TaskInProgress`, `TaskKeyReused`" (the reference's definition terms).
_LEADING_NAMES = re.compile(r"^`[^`]+`(?:,\s*`[^`]+`)*")
_NAME = re.compile(r"`([A-Za-z_]\w*)(?:\(.*\))?(?:\s*->\s*[^`]*)?`")


def _names_under_headings(text: str) -> Iterator[str]:
    """``<path>.<name>`` for each name that opens a line under a heading naming a path.

    The hand-written reference (docs/api.md) documents names this way, under
    "## `django_idempotency.recovery`"; code blocks are left to the import
    statements' pattern.
    """
    section: str | None = None
    in_code = False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
            continue
        heading = None if in_code else _HEADING.match(line)
        if heading:
            named = _MODULE_HEADING.match(heading.group(2).strip())
            section = named.group(1) if named else None
            continue
        leading = None if in_code or section is None else _LEADING_NAMES.match(line)
        if leading:
            for name in _NAME.findall(leading.group(0)):
                yield f"{section}.{name}"


_AUTODOC = re.compile(r"^::: (django_idempotency(?:\.\w+)*)\s*$")
_MEMBER = re.compile(r"^\s+- (\w+)\s*$")


def _mkdocstrings_members(text: str) -> Iterator[str]:
    """The objects of the generated reference: ``::: <path>`` and its ``members:`` list."""
    block: str | None = None
    for line in text.splitlines():
        opened = _AUTODOC.match(line)
        if opened:
            block = opened.group(1)
            yield block
            continue
        if block is None:
            continue
        member = _MEMBER.match(line)
        if member:
            yield f"{block}.{member.group(1)}"
        elif line.strip() and not line.startswith(" "):
            block = None  # the block's options ended


DOCUMENTED = documented_paths()


def resolve(path: str) -> Any:
    """The object a dotted path names: the longest importable module, then attributes."""
    parts = path.split(".")
    for split in range(len(parts), 0, -1):
        module_name = ".".join(parts[:split])
        try:
            found: Any = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            # Only "this module does not exist" means "look for an attribute";
            # a module that exists but fails to import is an error to show.
            if exc.name is None or not module_name.startswith(exc.name):
                raise
            continue
        for attribute in parts[split:]:
            found = getattr(found, attribute)
        return found
    raise ModuleNotFoundError(path)


def test_the_docs_extraction_finds_the_import_paths_the_docs_are_known_to_show() -> None:
    # Guards the extraction itself: a regex that matched nothing would make
    # the parametrized test below pass vacuously.
    assert {
        "django_idempotency.idempotent",
        "django_idempotency.drf.IdempotentMixin",
        "django_idempotency.recovery.register_reconciler",
        "django_idempotency.tasks.BEAT_SCHEDULE",
        "django_idempotency.testing.simulate_crash_after_begin_external",
        "django_idempotency.scope.default_tenant",
        "django_idempotency.exceptions.KeyReused",  # a member of a ::: block of docs/api.md
        "django_idempotency.signals.request_claimed",
    } <= DOCUMENTED.keys()
    assert not any(_NOT_AN_IMPORT_PATH.match(path) for path in DOCUMENTED)


@pytest.mark.parametrize("path", list(DOCUMENTED))
def test_every_import_path_the_docs_show_imports(path: str) -> None:
    try:
        resolve(path)
    except (ImportError, AttributeError) as exc:
        shown_in = ", ".join(DOCUMENTED[path])
        pytest.fail(f"{path} is shown in {shown_in} but does not import: {exc}")


# -- what SPEC's "Public contract" fixes ----------------------------------------------

SPEC_FIELDS = {
    "tenant",
    "operation",
    "key",
    "fingerprint",
    "state",
    "lease_owner",
    "lease_expires_at",
    "fencing_token",
    "provider_key",
    "provider_operation_id",
    "response_status",
    "response_headers",
    "response_body",
    "created_at",
    "updated_at",
    "expires_at",
}
SPEC_STATES = {"CLAIMED", "IN_PROGRESS", "UNCERTAIN", "COMPLETED", "FAILED"}
SPEC_COMMANDS = {"idempotency_recover", "idempotency_purge"}
SPEC_SETTINGS: dict[str, Any] = {
    "HEADER": "Idempotency-Key",
    "REQUIRED": True,
    "KEY_MAX_LENGTH": 255,
    "TTL": 24 * 3600,
    "LEASE": 2 * 60,
    "DATABASE": "default",
    "IN_FLIGHT": "conflict",
    "FAIL_OPEN": False,
}


@pytest.mark.parametrize("path", SPEC_PATHS)
def test_every_name_spec_fixes_imports(path: str) -> None:
    assert resolve(path) is not None


def test_idempotent_takes_the_keyword_arguments_spec_fixes() -> None:
    parameters = inspect.signature(idempotent).parameters
    keywords = {
        name
        for name, parameter in parameters.items()
        if parameter.kind in (parameter.KEYWORD_ONLY, parameter.POSITIONAL_OR_KEYWORD)
    }
    assert {"fingerprint", "operation", "required", "ttl"} <= keywords


def test_the_mixin_reads_the_class_attributes_matching_idempotents_arguments() -> None:
    from django_idempotency.drf import IdempotentMixin

    for name in ("fingerprint", "operation", "required", "ttl"):
        assert getattr(IdempotentMixin, f"idempotency_{name}") is None


def test_the_model_has_the_app_label_fields_states_and_unique_scope_spec_fixes() -> None:
    from django_idempotency.models import IdempotencyRecord

    meta = IdempotencyRecord._meta
    assert meta.app_label == "django_idempotency"
    assert {field.name for field in meta.get_fields()} >= SPEC_FIELDS
    assert {state.value for state in IdempotencyRecord.State} == SPEC_STATES
    assert {state.name for state in IdempotencyRecord.State} == SPEC_STATES
    unique_scopes = [
        tuple(constraint.fields)
        for constraint in meta.constraints
        if isinstance(constraint, models.UniqueConstraint) and constraint.condition is None
    ]
    assert ("tenant", "operation", "key") in unique_scopes


def test_the_reconciler_outcomes_spec_fixes_take_what_a_reconciler_gives() -> None:
    from django_idempotency.recovery import Completed, Failed, Retry

    assert Completed(status=201, body={"id": 1}).status == 201
    assert Failed(status=402, body=b"declined").status == 402
    assert Retry(after=60).after == 60


def test_the_celery_tasks_spec_fixes_are_registered_under_their_dotted_names() -> None:
    from django_idempotency import tasks

    assert tasks.recover_stale_records.name == "django_idempotency.tasks.recover_stale_records"
    assert tasks.purge_expired_records.name == "django_idempotency.tasks.purge_expired_records"
    assert {entry["task"] for entry in tasks.BEAT_SCHEDULE.values()} == {
        "django_idempotency.tasks.recover_stale_records",
        "django_idempotency.tasks.purge_expired_records",
        "django_idempotency.tasks.observe_records",
    }
    assert callable(tasks.idempotent_task(key="event_id"))


def documented_commands() -> set[str]:
    text = "\n".join(document.read_text(encoding="utf-8") for document in DOCUMENTS)
    return set(re.findall(r"manage\.py\s+(idempotency_\w+)", text))


def test_every_command_spec_fixes_or_the_docs_show_is_the_packages() -> None:
    commands = get_commands()
    expected = SPEC_COMMANDS | documented_commands()
    assert {name: commands.get(name) for name in expected} == dict.fromkeys(
        expected, "django_idempotency"
    )


def test_the_settings_spec_fixes_have_its_defaults(settings: Any) -> None:
    from django_idempotency.conf import idempotency_settings
    from django_idempotency.scope import default_tenant

    if hasattr(settings, "IDEMPOTENCY"):
        del settings.IDEMPOTENCY
    for name, default in SPEC_SETTINGS.items():
        value = getattr(idempotency_settings, name)
        seconds = value.total_seconds() if hasattr(value, "total_seconds") else value
        assert (name, seconds) == (name, default)
    assert idempotency_settings.TENANT is default_tenant


# -- request.idempotency, seen by a real protected view -------------------------------

_seen: list[Any] = []


@api_view(["POST"])
@idempotent(operation="public-api probe")
def _probe(request: Request) -> Response:
    context = request.idempotency  # type: ignore[attr-defined]
    _seen.append(context)
    provider_key = context.begin_external()
    context.set_provider_operation("op-1")
    return Response({"provider_key": provider_key}, status=201)


def context_of_a_protected_request() -> Any:
    _seen.clear()
    request = APIRequestFactory().post(
        "/probe", {"amount": 1}, format="json", HTTP_IDEMPOTENCY_KEY="probe-key"
    )
    response = _probe(request)
    assert response.status_code == 201, response.content
    (context,) = _seen
    return context


@pytest.mark.django_db
def test_request_idempotency_offers_what_spec_fixes() -> None:
    from django_idempotency.models import IdempotencyRecord

    context = context_of_a_protected_request()

    assert (context.key, context.tenant, context.operation) == (
        "probe-key",
        "anonymous",
        "public-api probe",
    )
    assert context.fencing_token == 1
    record = IdempotencyRecord.objects.get(key="probe-key")
    assert (record.provider_key, record.provider_operation_id) == (context.provider_key, "op-1")
    assert all(callable(getattr(context, name)) for name in SPEC_CONTEXT_METHODS)
    assert all(hasattr(context, name) for name in SPEC_CONTEXT_ATTRIBUTES)


# -- the snapshot ---------------------------------------------------------------------


def signature(function: Callable[..., Any]) -> str:
    """Parameter names, kinds and defaults; annotations left out (types may be refined)."""
    found = inspect.signature(function)
    parameters = [p.replace(annotation=inspect.Parameter.empty) for p in found.parameters.values()]
    text = str(found.replace(parameters=parameters, return_annotation=inspect.Signature.empty))
    return re.sub(r" at 0x[0-9a-f]+", "", text)


def describe(value: Any) -> str:
    if isinstance(value, types.ModuleType):
        return "module"
    if isinstance(value, property):
        return "property"
    if isinstance(value, set | frozenset):
        # Sorted: a set of strings iterates in a different order in each process.
        return f"{type(value).__name__} = {sorted(value, key=repr)!r}"
    if hasattr(value, "run") and type(value).__module__.startswith("celery"):
        return f"celery task {value.name!r}{signature(value.run)}"
    if isinstance(value, type):
        return describe_class(value)
    if isinstance(value, types.GenericAlias | types.UnionType) or type(value).__module__ in (
        "typing",
        "collections.abc",
    ):
        return f"type alias = {value!r}"  # Reconciler, ReconcilerOutcome...
    if callable(value):
        return f"function{signature(value)}"
    if isinstance(value, Signal):
        return "signal"
    if isinstance(value, dict | list):
        return f"{type(value).__name__} = {json.dumps(value, sort_keys=True, default=repr)}"
    return f"{type(value).__name__} = {value!r}"


def _constructed_by_a_builtin(cls: type) -> bool:
    """Whether ``cls`` is constructed by a builtin type's ``__init__``, not ``object``'s."""
    for klass in cls.__mro__:
        if "__init__" in vars(klass) or "__new__" in vars(klass):
            return klass.__module__ == "builtins" and klass is not object
    return False


def describe_class(cls: type) -> str:
    # Public bases only: users catch and subclass those; private ones may move.
    bases = ", ".join(base.__name__ for base in cls.__bases__ if not base.__name__.startswith("_"))
    text = f"class({bases})"
    if issubclass(cls, enum.Enum):
        return f"{text} values {[member.value for member in cls]}"
    if issubclass(cls, models.Model):
        return text  # its fields: see the model's own lines
    # A constructor a builtin base defines has a signature on some Pythons
    # only (set's: none on 3.11 and 3.12, "(iterable=(), /)" on 3.13).
    if not _constructed_by_a_builtin(cls):
        with contextlib.suppress(ValueError):
            text += signature(cls)
    if dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen:  # type: ignore[attr-defined]
        text += " frozen"
    # A refusal's HTTP status and code are what clients see.
    for attribute in ("status_code", "default_code"):
        if attribute in vars(cls):
            text += f" {attribute}={vars(cls)[attribute]!r}"
    # The mixin's options, and any other documented class attributes of this kind.
    for name, value in sorted(vars(cls).items()):
        if name.startswith("idempotency_") and not (
            callable(value) or isinstance(value, classmethod | staticmethod)
        ):
            text += f" {name}={value!r}"
    return text


def documented_modules() -> list[str]:
    modules = set()
    for path in [*DOCUMENTED, *SPEC_PATHS]:
        # A path that does not import is reported by its own test above.
        with contextlib.suppress(ImportError, AttributeError):
            value = resolve(path)
            modules.add(path if isinstance(value, types.ModuleType) else value.__module__)
    return sorted(
        name
        for name in modules
        if name.split(".")[0] == "django_idempotency"
        and name in DOCUMENTED
        # A page that explains the internals names private modules: not API.
        and not any(part.startswith("_") for part in name.split("."))
    )


#: Stands for a path that does not import (its own test fails too).
MISSING = object()


def public_names() -> Iterator[tuple[str, Any]]:
    """Every documented or SPEC-fixed path, and every name in a documented module's ``__all__``."""
    paths = {
        path
        for path in set(DOCUMENTED) | set(SPEC_PATHS)
        if not any(part.startswith("_") and not part.endswith("__") for part in path.split(".")[1:])
    }
    for module_name in documented_modules():
        module = resolve(module_name)
        paths.update(f"{module_name}.{name}" for name in getattr(module, "__all__", ()))
    for path in sorted(paths):
        if _NOT_AN_IMPORT_PATH.match(path):
            continue
        try:
            yield path, resolve(path)
        except (ImportError, AttributeError):
            yield path, MISSING


def model_lines() -> Iterator[str]:
    from django_idempotency.models import IdempotencyRecord

    meta = IdempotencyRecord._meta
    prefix = "model django_idempotency.models.IdempotencyRecord"
    yield f"{prefix} app_label={meta.app_label!r} db_table={meta.db_table!r}"
    for field in meta.concrete_fields:
        null = " null" if field.null else ""
        yield f"{prefix} field {field.name}: {type(field).__name__}{null}"
    for state in IdempotencyRecord.State:
        yield f"{prefix} State.{state.name} = {state.value!r}"
    for constraint in meta.constraints:
        if isinstance(constraint, models.UniqueConstraint):
            yield f"{prefix} unique {constraint.name} {list(constraint.fields)}"


def settings_lines() -> Iterator[str]:
    from django_idempotency.conf import DEFAULTS

    for name, default in sorted(DEFAULTS.items()):
        yield f'setting IDEMPOTENCY["{name}"] default {default!r}'


def command_lines() -> Iterator[str]:
    base = {action.dest for action in BaseCommand().create_parser("manage.py", "base")._actions}
    for name, app in sorted(get_commands().items()):
        if app != "django_idempotency":
            continue
        parser = load_command_class(app, name).create_parser("manage.py", name)
        options = [
            f"{'/'.join(action.option_strings) or action.dest}={action.default!r}"
            for action in parser._actions
            if action.dest not in base
        ]
        yield f"command {name} {' '.join(options)}".rstrip()


def context_lines() -> Iterator[str]:
    context_class = type(context_of_a_protected_request())
    for name, value in sorted(inspect.getmembers(context_class)):
        if name.startswith("_"):
            continue
        if isinstance(value, property):
            yield f"request.idempotency.{name}: property"
        elif callable(value):
            yield f"request.idempotency.{name}{signature(value)}"


def current_snapshot() -> str:
    lines = [
        f"{path}: {'MISSING' if value is MISSING else describe(value)}"
        for path, value in public_names()
    ]
    lines += [*model_lines(), *context_lines(), *settings_lines(), *command_lines()]
    # No memory address may reach the snapshot: it differs in every process.
    return re.sub(r" at 0x[0-9a-f]+", "", "\n".join(lines) + "\n")


@pytest.mark.django_db
def test_the_public_api_matches_its_snapshot() -> None:
    current = current_snapshot()
    if os.environ.get(UPDATE_VARIABLE) == "1":
        SNAPSHOT.write_text(current, encoding="utf-8")
    recorded = SNAPSHOT.read_text(encoding="utf-8") if SNAPSHOT.exists() else ""
    diff = "\n".join(
        difflib.unified_diff(
            recorded.splitlines(), current.splitlines(), "recorded", "now", lineterm="", n=0
        )
    )
    assert current == recorded, f"{HOW_TO_UPDATE}\n{diff}"
