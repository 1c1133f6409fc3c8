"""A previous release's tree, extracted from this clone's history with ``git archive``.

Shared by the upgrade tests: tests/test_upgrade_from_previous_release.py
(the previous release fills a database, this code serves it) and
tests/live/test_rolling_upgrade.py (both serve one database at once).

``PREVIOUS_RELEASE`` names it. A shallow clone lacks old commits: the test
is skipped locally and fails under ``IDEMPOTENCY_REQUIRE_SERVICES=1`` (CI),
which must fetch the history.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: The release upgraded from, and served beside this checkout: the commit of
#: the last release tagged. Move it to each release's commit when its tag is
#: made (docs/upgrading.md).
#: 1.0.0rc1 (tag v1.0.0rc1).
PREVIOUS_RELEASE = "2f1043a33291352c353c0ab12f14a6fa60cb8409"
REQUIRE_SERVICES = os.environ.get("IDEMPOTENCY_REQUIRE_SERVICES") == "1"


def extract_release(
    commit: str, paths: Iterable[str], into: Path, *, also: Iterable[Path] = ()
) -> Path:
    """``paths`` of ``commit`` under ``into``, with ``also`` (files of this checkout) copied in.

    The files of ``also`` keep their place relative to the repository root:
    helpers written for both trees (a fill script, a settings module).
    """
    try:
        found = subprocess.run(
            ["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}^{{commit}}"],
            capture_output=True,
            text=True,
        )
        problem = found.stderr.strip() if found.returncode else ""
    except FileNotFoundError:
        problem = "git is not installed"
    if problem:
        why = (
            f"The previous release, commit {commit}, is not in this clone ({problem}); a "
            "shallow clone lacks it. Fetch it (git fetch --unshallow, or actions/checkout "
            "with fetch-depth: 0)."
        )
        if REQUIRE_SERVICES:
            pytest.fail(f"IDEMPOTENCY_REQUIRE_SERVICES=1: {why}")
        pytest.skip(why)
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", commit, *paths], capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    for path in also:
        target = into / path.resolve().relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, target)
    return into


def assert_runs_from(tree: Path, environment: Mapping[str, str]) -> None:
    """A process started in ``tree`` with ``environment`` imports the package and tests from it.

    The whole point of these tests: the previous release's code serves, not
    this checkout's (installed editable, or first on a PYTHONPATH).
    """
    probe = (
        "import django_idempotency, tests.settings; "
        "print(django_idempotency.__file__); print(tests.settings.__file__)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tree,
        env=dict(environment),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    for line in done.stdout.split():
        assert Path(line).resolve().is_relative_to(tree.resolve()), line
