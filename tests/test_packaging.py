"""Migrations, import safety and the package's public names."""

from __future__ import annotations

import os
import subprocess
import sys
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.django_db
def test_no_model_change_lacks_a_migration() -> None:
    out = StringIO()
    try:
        call_command("makemigrations", "--check", "--dry-run", stdout=out, stderr=out)
    except SystemExit as exc:  # --check exits 1 when a migration is missing
        pytest.fail(f"A model change has no migration:\n{out.getvalue()} (exit {exc.code})")


def test_importing_the_package_before_django_setup_works() -> None:
    # tasks.py too: settings files import BEAT_SCHEDULE from it.
    code = (
        "import django_idempotency, django_idempotency.conf;"
        "from django_idempotency.tasks import BEAT_SCHEDULE, idempotent_task;"
        "assert BEAT_SCHEDULE;"
        "print(django_idempotency.__version__)"
    )
    env = {key: value for key, value in os.environ.items() if key != "DJANGO_SETTINGS_MODULE"}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()


def test_public_names_resolve() -> None:
    from django_idempotency import idempotent
    from django_idempotency.drf import IdempotentMixin
    from django_idempotency.models import IdempotencyRecord

    assert callable(idempotent)
    assert IdempotentMixin.__name__ == "IdempotentMixin"
    assert [state.name for state in IdempotencyRecord.State] == [
        "CLAIMED",
        "IN_PROGRESS",
        "UNCERTAIN",
        "COMPLETED",
        "FAILED",
    ]
    constraint = IdempotencyRecord._meta.constraints[0]
    assert constraint.fields == ("tenant", "operation", "key")  # type: ignore[attr-defined]


def _package_modules() -> list[str]:
    import pkgutil

    import django_idempotency

    return [
        module.name
        for module in pkgutil.walk_packages(django_idempotency.__path__, "django_idempotency.")
        if ".migrations" not in module.name
        and ".management.commands" not in module.name
        # Empty packages that only make a folder importable.
        and module.name not in ("django_idempotency.management", "django_idempotency.templatetags")
    ]


def _is_private(name: str) -> bool:
    return any(part.startswith("_") for part in name.split("."))


PUBLIC_MODULES = [name for name in _package_modules() if not _is_private(name)]
PRIVATE_MODULES = [name for name in _package_modules() if _is_private(name)]


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_every_public_module_says_what_it_offers_in_all(name: str) -> None:
    import importlib

    module = importlib.import_module(name)
    offered = getattr(module, "__all__", None)

    assert offered is not None, f"{name} has no __all__"
    assert sorted(offered) == sorted(set(offered)), f"{name}.__all__ repeats a name"
    assert [item for item in offered if not hasattr(module, item)] == []


@pytest.mark.parametrize("name", PRIVATE_MODULES)
def test_private_modules_offer_nothing_in_all_but_their_packages_facade(name: str) -> None:
    # ``__all__`` marks what users may import; a private module has nothing
    # of the kind (a private package's __init__ may list what its siblings use).
    import importlib

    module = importlib.import_module(name)
    is_package = hasattr(module, "__path__")
    assert is_package or not hasattr(module, "__all__"), f"{name} is private but has __all__"


@pytest.mark.parametrize(
    "name", [name for name in _package_modules() if name.count(".") == 1 and _is_private(name)]
)
def test_every_private_package_says_what_it_owns_and_who_may_import_it(name: str) -> None:
    import importlib

    doc = importlib.import_module(name).__doc__ or ""
    assert "import" in doc.lower(), f"{name}'s docstring does not say what may import it"
    assert len(doc.split()) > 30, f"{name}'s docstring does not say what it owns"


def test_the_request_path_does_not_import_the_test_helpers() -> None:
    # testing.py is for users' test suites; the crash it stages is shared
    # through simulated_crash.py, so that serving requests never loads it.
    code = (
        "import django; django.setup();"
        "import sys, django_idempotency.decorators, django_idempotency.drf,"
        " django_idempotency.tasks, django_idempotency.recovery, django_idempotency.admin;"
        "print('django_idempotency.testing' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=os.environ
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_the_package_offers_the_three_entry_points_lazily() -> None:
    # Importing the package loads none of them (nor DRF, nor Celery); each
    # loads at first use and is the very object of its home module.
    code = (
        "import sys, django_idempotency as package;"
        "heavy = ('django_idempotency.', 'rest_framework', 'celery');"
        "loaded = {m for m in sys.modules if m.startswith(heavy)};"
        "assert not loaded, loaded;"
        "import django; django.setup();"
        "from django_idempotency import idempotent, IdempotentMixin, idempotent_task;"
        "from django_idempotency import decorators, drf, tasks;"
        "assert idempotent is decorators.idempotent;"
        "assert IdempotentMixin is drf.IdempotentMixin;"
        "assert idempotent_task is tasks.idempotent_task;"
        "assert set(package.__all__) <= set(dir(package));"
        "print('ok')"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=os.environ
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_unknown_attribute_of_the_package_is_an_attribute_error() -> None:
    import django_idempotency

    with pytest.raises(AttributeError):
        django_idempotency.no_such_name  # noqa: B018


def test_a_non_positive_ttl_is_refused_when_decorating() -> None:
    from django.core.exceptions import ImproperlyConfigured

    from django_idempotency import idempotent

    with pytest.raises(ImproperlyConfigured, match="ttl"):
        idempotent(ttl=0)(lambda request: None)


def test_non_atomic_requests_stacked_on_top_keeps_every_database_exempt() -> None:
    from django.db import transaction

    from django_idempotency import idempotent

    view = transaction.non_atomic_requests(idempotent(lambda request: None))
    exempt = vars(view)["_non_atomic_requests"]  # set by Django, declared by no stub
    assert "default" in exempt
    assert "any-other-alias" in exempt


def test_the_changelog_has_a_dated_section_for_this_version_and_an_unreleased_one() -> None:
    import re

    import django_idempotency

    changelog = Path(ROOT, "CHANGELOG.md").read_text(encoding="utf-8")
    version = re.escape(django_idempotency.__version__)
    assert re.search(rf"^## \[{version}\] - \d{{4}}-\d\d-\d\d$", changelog, re.MULTILINE)
    assert re.search(r"^## \[Unreleased\]$", changelog, re.MULTILINE)


def test_a_pre_release_is_classified_beta() -> None:
    import re

    import django_idempotency

    pyproject = Path(ROOT, "pyproject.toml").read_text(encoding="utf-8")
    pre_release = re.search(r"(a|b|rc|\.dev)\d+$", django_idempotency.__version__)
    stage = "4 - Beta" if pre_release else "5 - Production/Stable"
    assert f'"Development Status :: {stage}"' in pyproject


def load_check_dist() -> object:
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "check_dist", os.path.join(ROOT, "scripts", "check_dist.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_wheel(path: str, names: list[str]) -> None:
    import zipfile

    with zipfile.ZipFile(path, "w") as archive:
        for name in names:
            archive.writestr(name, "")


def test_the_dist_check_accepts_the_package_alone_and_names_what_else_a_wheel_holds(
    tmp_path: object,
) -> None:
    check_dist: Any = load_check_dist()
    expected = check_dist.tracked_package_files()
    metadata = ["django_idempotency-1.0.0rc1.dist-info/METADATA"]
    whole, stray, partial = (os.path.join(str(tmp_path), f"{n}.whl") for n in "abc")
    write_wheel(whole, [*sorted(expected), *metadata])
    write_wheel(stray, [*sorted(expected), *metadata, "tests/settings.py", "testproject/x.py"])
    missing = "django_idempotency/_store/digests.py"
    write_wheel(partial, [*sorted(expected - {missing}), *metadata])

    assert check_dist.wheel_problems(Path(whole), expected) == []
    stray_problems = check_dist.wheel_problems(Path(stray), expected)
    assert any("tests/settings.py" in problem for problem in stray_problems)
    assert any("'testproject'" in problem for problem in stray_problems)
    assert check_dist.wheel_problems(Path(partial), expected) == [f"wheel lacks {missing}"]
