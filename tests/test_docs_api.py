"""docs/api.md, rendered by mkdocstrings, lists every public name and only real ones.

The page renders the names its ``:::`` blocks list. A public name nobody
listed never appears; a listed name that does not exist breaks only the
docs build; a listed one without a docstring appears as a bare heading.
These tests catch all three in the test suite, with ``__all__`` as the
list of public names where a module has one.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.utils import SPEC_CONTEXT_ATTRIBUTES, SPEC_CONTEXT_METHODS, SPEC_PATHS

API_PAGE = Path(__file__).resolve().parent.parent / "docs" / "api.md"

#: The names SPEC's "Public contract" fixes, by the path users import them from.
CONTRACT = {
    *SPEC_PATHS,
    *(
        f"django_idempotency.context.IdempotencyContext.{name}"
        for name in (*SPEC_CONTEXT_ATTRIBUTES, *SPEC_CONTEXT_METHODS)
    ),
}

#: Names a documented module offers in ``__all__`` (to the package's other
#: modules) that the reference leaves out on purpose, each with the reason.
#: A new name in an ``__all__`` goes on the page or here: never nowhere.
NOT_IN_THE_REFERENCE = {
    "django_idempotency.IdempotentMixin": "on the page as django_idempotency.drf's",
    "django_idempotency.idempotent_task": "on the page as django_idempotency.tasks'",
    "django_idempotency.context.derive_provider_key": "views read provider_key",
    "django_idempotency.drf.protection_of": "for checks and OpenAPI; returns protection.Options",
    "django_idempotency.exceptions.UNREADABLE_RECORD": "a message StoreUnavailable carries",
    "django_idempotency.fingerprint.CSRF_FORM_FIELD": "docs/fingerprints.md says what it means",
    "django_idempotency.fingerprint.MAX_POSITIONAL_EXPONENT": "docs/fingerprints.md says it",
    "django_idempotency.fingerprint.NestedTooDeeply": "raised by request_fingerprint only",
    "django_idempotency.fingerprint.fingerprint": "returns the private digests.Fingerprint",
    "django_idempotency.fingerprint.request_fingerprint": "the protection's step",
    "django_idempotency.fingerprint.select_fields": "the protection's step",
    "django_idempotency.models.FINGERPRINT_MAX_LENGTH": "a column size",
    "django_idempotency.models.KEY_MAX_LENGTH": "a column size; the record's docstring says it",
    "django_idempotency.models.OPERATION_MAX_LENGTH": "a column size; the record's docstring too",
    "django_idempotency.models.STEP_NAME_MAX_LENGTH": "a column size; begin_external's docstring",
    "django_idempotency.models.TENANT_MAX_LENGTH": "a column size; the record's docstring too",
    "django_idempotency.recovery.DEFAULT_BACKOFF": "register_reconciler's docstring says it",
    "django_idempotency.recovery.settle": "one step of a recovery run, for the admin",
    "django_idempotency.recovery.leased_records": "for the recover command's dry run",
    "django_idempotency.recovery.registered_operations": "for the system checks (W004)",
    "django_idempotency.outcomes.Verdict": "responses.Verdict, re-exported: on the page there",
    "django_idempotency.outcomes.mark_input_refused": "the DRF glue's step (decorators.py)",
    "django_idempotency.responses.capture": "the protection's step",
    "django_idempotency.responses.replay": "the protection's step",
    "django_idempotency.responses.verdict_of": "docs/responses.md has the table of statuses",
    "django_idempotency.scope.DIGEST_PREFIX": "docs/settings.md#tenants says it",
    "django_idempotency.scope.credential_digest": "default_tenant's step",
    "django_idempotency.scope.digest": "the protection's step",
    "django_idempotency.scope.resolve_operation": "the protection's step",
    "django_idempotency.scope.check_operation_spec": "the options' step; docs/settings.md",
    "django_idempotency.scope.operation_name_fault": "the rule docs/settings.md states",
    "django_idempotency.scope.resolve_tenant": "the protection's step",
    "django_idempotency.scope.normalised_route": "OPERATION_NAMES' step; docs/settings.md",
    "django_idempotency.scope.operation_name": "OPERATION_NAMES' step, shared with the checks",
    "django_idempotency.signals.notify": "the package's sender",
    "django_idempotency.testing.REFUSAL_CODES": "exceptions.REFUSAL_CODES, on the page",
}


@dataclass(frozen=True)
class Block:
    """One ``::: path`` block of the page and the members it lists."""

    path: str
    members: tuple[str, ...]


def read_blocks(text: str) -> list[Block]:
    blocks = []
    lines = text.splitlines()
    for index, line in enumerate(lines):
        match = re.fullmatch(r":::\s+(\S+)\s*", line)
        if match is None:
            continue
        options = []
        for option in lines[index + 1 :]:
            if option.strip() and not option.startswith(" "):
                break
            options.append(option)
        blocks.append(Block(match.group(1), read_members(options)))
    return blocks


def read_members(options: list[str]) -> tuple[str, ...]:
    """The ``members:`` list of a block's YAML options, written as a block list."""
    members: list[str] = []
    listing = None
    for line in options:
        if re.fullmatch(r"\s+members:\s*", line):
            listing = len(line) - len(line.lstrip())
        elif listing is not None:
            item = re.fullmatch(r"(\s+)- (\w+)\s*", line)
            if item is None or len(item.group(1)) <= listing:
                break
            members.append(item.group(2))
        elif re.match(r"\s+members:", line):
            raise AssertionError(f"Write members as a block list, one name a line: {line!r}")
    return tuple(members)


BLOCKS = read_blocks(API_PAGE.read_text(encoding="utf-8"))


def split_module(path: str) -> tuple[str, list[str]]:
    """``a.b.C.m`` -> (``a.b``, [``C``, ``m``]): the longest prefix that is a module."""
    parts = path.split(".")
    for end in range(len(parts), 0, -1):
        module = ".".join(parts[:end])
        try:
            spec = importlib.util.find_spec(module)
        except ModuleNotFoundError:  # a prefix that is a module, not a package
            continue
        if spec is not None:
            return module, parts[end:]
    raise AssertionError(f"docs/api.md documents {path}, which is in no module")


def documented_names() -> dict[str, set[str]]:
    """Each module the page documents, and the names it lists of the module."""
    names: dict[str, set[str]] = {}
    for block in BLOCKS:
        module, attributes = split_module(block.path)
        if attributes:
            names.setdefault(module, set()).add(attributes[0])
        else:
            names.setdefault(module, set()).update(block.members)
    return names


def documented_paths() -> list[str]:
    """Every dotted path the page renders: the blocks' own and their members'."""
    paths = []
    for block in BLOCKS:
        paths.append(block.path)
        paths.extend(f"{block.path}.{member}" for member in block.members)
    return paths


def test_the_page_has_blocks_and_module_blocks_list_their_members() -> None:
    # Without a member list a module block renders whatever the filters
    # keep, and nothing here would say which names the page documents.
    assert len(BLOCKS) >= 10
    for block in BLOCKS:
        _, attributes = split_module(block.path)
        assert attributes or block.members, f"::: {block.path} lists no members"


def test_the_names_spec_fixes_are_in_the_reference() -> None:
    missing = CONTRACT - set(documented_paths())
    assert not missing, f"docs/api.md lacks names SPEC fixes: {sorted(missing)}"


def left_out(module_name: str) -> set[str]:
    prefix = module_name + "."
    return {
        path.removeprefix(prefix)
        for path in NOT_IN_THE_REFERENCE
        if path.startswith(prefix) and "." not in path.removeprefix(prefix)
    }


@pytest.mark.parametrize("module_name", sorted(documented_names()))
def test_every_name_in_a_documented_modules_all_is_in_the_reference(module_name: str) -> None:
    module = importlib.import_module(module_name)
    public = set(getattr(module, "__all__", ()))
    missing = public - documented_names()[module_name] - left_out(module_name)
    assert not missing, (
        f"{module_name}.__all__ names {sorted(missing)}, which docs/api.md does not list "
        "(document them, or say in NOT_IN_THE_REFERENCE why not)"
    )


def test_names_left_out_of_the_reference_are_in_an_all_and_not_on_the_page() -> None:
    # A stale entry would let a later public name of that spelling slip by.
    for path in NOT_IN_THE_REFERENCE:
        module_name, attributes = split_module(path)
        assert attributes[0] in importlib.import_module(module_name).__all__, path
        assert attributes[0] not in documented_names().get(module_name, set()), path


@pytest.mark.parametrize("module_name", sorted(documented_names()))
def test_the_reference_lists_only_names_in_the_modules_all(module_name: str) -> None:
    # One list of public names: a name worth documenting is public, and
    # belongs in __all__ (which the snapshot of the public API reads).
    module = importlib.import_module(module_name)
    assert hasattr(module, "__all__"), f"{module_name} has no __all__"
    extra = documented_names()[module_name] - set(module.__all__)
    assert not extra, f"docs/api.md lists {sorted(extra)}, missing from {module_name}.__all__"


@pytest.mark.parametrize("path", documented_paths())
def test_every_name_the_reference_lists_exists(path: str) -> None:
    module_name, attributes = split_module(path)
    target: object = importlib.import_module(module_name)
    for depth, attribute in enumerate(attributes):
        assert hasattr(target, attribute), (
            f"docs/api.md lists {path}, but {'.'.join([module_name, *attributes[:depth]])} "
            f"has no {attribute}"
        )
        target = getattr(target, attribute)


@pytest.mark.parametrize("path", documented_paths())
def test_every_name_the_reference_lists_has_a_docstring(path: str) -> None:
    # Read from the source, as griffe reads it for the page: an attribute's
    # docstring is the string after its assignment, a dataclass's is not the
    # signature Python fills in, and a re-exported name is documented where
    # it is defined.
    module_name, attributes = split_module(path)
    assert docstring(module_name, attributes), (
        f"{path} has no docstring: the page shows its name only"
    )


def docstring(module_name: str, attributes: list[str]) -> str | None:
    tree = parse(module_name)
    if not attributes:
        return ast.get_docstring(tree)
    found = find(tree.body, attributes[0])
    if isinstance(found, ast.ImportFrom):
        imported = next(alias.name for alias in found.names if bound_name(alias) == attributes[0])
        return docstring(imported_from(module_name, found), [imported, *attributes[1:]])
    for attribute in attributes[1:]:
        assert isinstance(found, ast.ClassDef), f"{module_name}: {attributes} is not in a class"
        found = find(found.body, attribute)
    return text_of(found)


def parse(module_name: str) -> ast.Module:
    spec = importlib.util.find_spec(module_name)
    assert spec is not None and spec.origin is not None, f"no source for {module_name}"
    return ast.parse(Path(spec.origin).read_text(encoding="utf-8"))


def imported_from(module_name: str, statement: ast.ImportFrom) -> str:
    """The module a ``from ... import`` in ``module_name`` reads, relative or not."""
    if not statement.level:
        assert statement.module is not None
        return statement.module
    spec = importlib.util.find_spec(module_name)
    assert spec is not None
    is_package = spec.submodule_search_locations is not None
    package = module_name if is_package else module_name.rpartition(".")[0]
    relative = "." * statement.level + (statement.module or "")
    return importlib.util.resolve_name(relative, package)


def bound_name(alias: ast.alias) -> str:
    return alias.asname or alias.name


Definition = ast.stmt | tuple[ast.stmt, ast.stmt | None]


def find(body: list[ast.stmt], name: str) -> Definition | None:
    """The statement defining ``name`` in ``body`` (with the statement after an assignment).

    Looks into ``if`` and ``try`` blocks too: ``if TYPE_CHECKING:`` imports
    and guarded imports bind names as well. The last definition wins.
    """
    found: Definition | None = None
    for index, statement in enumerate(body):
        following = body[index + 1] if index + 1 < len(body) else None
        if isinstance(statement, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            if statement.name == name:
                found = statement
        elif isinstance(statement, ast.Assign | ast.AnnAssign):
            targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
            if any(isinstance(target, ast.Name) and target.id == name for target in targets):
                found = (statement, following)
        elif isinstance(statement, ast.ImportFrom):
            if any(bound_name(alias) == name for alias in statement.names):
                found = statement
        elif isinstance(statement, ast.If | ast.Try):
            nested = [*statement.body, *statement.orelse]
            if isinstance(statement, ast.Try):
                nested += [line for handler in statement.handlers for line in handler.body]
            found = find(nested, name) or found
    return found


def text_of(found: Definition | None) -> str | None:
    if isinstance(found, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
        return ast.get_docstring(found)
    if isinstance(found, tuple):
        following = found[1]
        if (
            isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            return following.value.value
    return None


def test_reading_the_page_finds_member_lists() -> None:
    # The parser above is what every other test relies on: prove it reads
    # both block kinds and stops at the end of a block's options.
    page = """
::: package.module
    options:
      show_bases: false
      members:
        - first
        - Second

Text after the block.

::: package.module.Class
"""
    assert read_blocks(page) == [
        Block("package.module", ("first", "Second")),
        Block("package.module.Class", ()),
    ]


def test_docstrings_are_read_where_griffe_reads_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Re-exports (relative, absolute, under TYPE_CHECKING), attribute
    # docstrings, and a dataclass whose __doc__ Python fills in.
    package = tmp_path / "apidocs_sample"
    package.mkdir()
    (package / "__init__.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from apidocs_sample._impl import documented\n"
    )
    (package / "_impl.py").write_text(
        "import dataclasses\n"
        "def documented():\n"
        '    """Says what it does."""\n'
        "@dataclasses.dataclass\n"
        "class Report:\n"
        "    count: int = 0\n"
        "SCHEDULE = {}\n"
        '"""What the schedule holds."""\n'
        "BARE = 1\n"
    )
    (package / "public.py").write_text(
        "from ._impl import Report, SCHEDULE, BARE\nfrom apidocs_sample._impl import documented\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))

    assert docstring("apidocs_sample", ["documented"]) == "Says what it does."
    assert docstring("apidocs_sample.public", ["documented"]) == "Says what it does."
    assert docstring("apidocs_sample.public", ["SCHEDULE"]) == "What the schedule holds."
    assert docstring("apidocs_sample.public", ["Report"]) is None
    assert docstring("apidocs_sample.public", ["BARE"]) is None


#: Public modules used by naming them to Django rather than by importing
#: their names: the page says so in "Modules used through Django".
USED_THROUGH_DJANGO = {"apps", "urls", "admin", "checks", "conf", "decorators"}


def public_modules() -> set[str]:
    """The package's top-level modules and packages whose names do not start with ``_``."""
    package = Path(__file__).resolve().parent.parent / "django_idempotency"
    found = {path.stem for path in package.glob("*.py")}
    found |= {path.name for path in package.iterdir() if (path / "__init__.py").exists()}
    # migrations, management and templatetags are Django's to load.
    return {
        name
        for name in found - {"__init__", "migrations", "management", "templatetags"}
        if not name.startswith("_")
    }


def test_every_public_module_has_a_section_or_is_named_as_used_through_django() -> None:
    page = API_PAGE.read_text(encoding="utf-8")
    documented = {module.removeprefix("django_idempotency.") for module in documented_names()}
    section = page.split("## Modules used through Django", 1)
    assert len(section) == 2, "docs/api.md lacks its 'Modules used through Django' section"
    for name in USED_THROUGH_DJANGO:
        assert f"`django_idempotency.{name}`" in section[1], name
    missing = public_modules() - documented - USED_THROUGH_DJANGO
    assert not missing, f"public modules with no section in docs/api.md: {sorted(missing)}"
    assert not USED_THROUGH_DJANGO & documented, "a module is both documented and 'used through'"
