"""Check the built distributions in a directory before they are published.

    python scripts/check_dist.py dist

- ``twine check`` on the sdist and the wheel: the metadata PyPI renders
  (the README as the long description) is valid.
- The wheel holds exactly the package as it is tracked in git: every
  module of the public top level and of the private ``_`` subpackages, the
  migrations, the templates, ``py.typed`` and any translations; nothing
  else of the repository (``tests/``, ``testproject/``, ``benchmarks/``,
  ``scripts/``) and no byte-compiled leftovers.
- The sdist holds the package too, so that a wheel built from it is whole.

Exits 1 with a list of every problem found; prints what it checked
otherwise.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "django_idempotency"
#: Top-level directories of the repository that must never be installed.
NOT_SHIPPED = ("tests/", "testproject/", "benchmarks/", "scripts/", "docs/")
#: What a wheel without them would not work without, named for the message.
ESSENTIAL = (
    f"{PACKAGE}/__init__.py",
    f"{PACKAGE}/py.typed",
    f"{PACKAGE}/migrations/0001_create_idempotency_record.py",
    f"{PACKAGE}/_protection/__init__.py",
    f"{PACKAGE}/_store/__init__.py",
    f"{PACKAGE}/_observability/__init__.py",
    f"{PACKAGE}/_admin/__init__.py",
    f"{PACKAGE}/_openapi/__init__.py",
)


def tracked_package_files() -> set[str]:
    """The package's files as git tracks them: what a wheel must hold."""
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "--", PACKAGE],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return set(listed)


def wheel_problems(wheel: Path, expected: set[str]) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        names = {name for name in archive.namelist() if not name.endswith("/")}
    shipped = {name for name in names if name.startswith(f"{PACKAGE}/")}
    problems = [f"wheel lacks {name}" for name in sorted(expected - shipped)]
    problems += [
        f"wheel holds {name}, which git does not track" for name in sorted(shipped - expected)
    ]
    problems += [f"wheel lacks {name}" for name in ESSENTIAL if name not in shipped]
    problems += [
        f"wheel holds {name}, which is not part of the package"
        for name in sorted(names)
        if name.startswith(NOT_SHIPPED) or name.endswith((".pyc", ".pyo"))
    ]
    others = {name.split("/", 1)[0] for name in names - shipped}
    problems += [
        f"wheel holds a top-level {other!r} beside the package and its metadata"
        for other in sorted(others)
        if not other.endswith(".dist-info")
    ]
    return problems


def sdist_problems(sdist: Path, expected: set[str]) -> list[str]:
    with tarfile.open(sdist) as archive:
        # "django_idempotency-1.0.0rc1/django_idempotency/..." -> the path in the repository
        names = {member.name.split("/", 1)[-1] for member in archive.getmembers()}
    return [f"sdist lacks {name}" for name in sorted(expected - names)]


def main(dist: Path) -> int:
    wheels = sorted(dist.glob("*.whl"))
    sdists = sorted(dist.glob("*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        print(f"expected one wheel and one sdist in {dist}, found {wheels + sdists}")
        return 1
    twine = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", str(wheels[0]), str(sdists[0])]
    )
    expected = tracked_package_files()
    problems = wheel_problems(wheels[0], expected) + sdist_problems(sdists[0], expected)
    if twine.returncode:
        problems.append("twine check failed (above)")
    for problem in problems:
        print(f"dist-check: {problem}")
    if problems:
        return 1
    print(
        f"dist-check: {wheels[0].name} and {sdists[0].name} hold the package's "
        f"{len(expected)} files and nothing else of the repository"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "dist"))
