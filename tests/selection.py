"""Which tests a server pass can leave to the SQLite pass (a pytest plugin).

``runtests.py`` runs the suite three times: on SQLite, on PostgreSQL and on
MariaDB. A test that never reaches a database (a parser, a fingerprint, the
docs, the packaging, the public API snapshot, fuzzing of pure code) proves
the same thing in all three, so the server passes run with
``--database-tests-only`` and deselect it: it runs once, in the SQLite pass.

The rule is read from what pytest already knows at collection time, so a
new test needs no mark. A test is kept in every pass when it

- carries ``django_db``, ``postgres``, ``live``, ``fleet`` or ``database``
  (the last for a test that reaches a database pytest-django cannot see:
  another process, a server it starts);
- uses, directly or through its fixtures, one of pytest-django's database
  fixtures (``db``, ``transactional_db``, ``django_db_blocker`` as in a
  module-level fixture that unblocks the database, ``live_server``,
  ``django_assert_num_queries`` ...);
- is a Django ``TransactionTestCase`` or ``TestCase`` (their ``databases``);
- is skipped or expected to fail under some condition (``skip``, ``skipif``,
  ``xfail``, or ``not_under``/``only_under`` of a configuration): the SQLite
  pass may be the one that skips it;
- names the database in its own code (``connection``, ``connections``,
  ``vendor``, ``DATABASES``, ``ENGINE``, ``DATABASE_URL``): a test that
  compares engines, or skips itself on one, without querying;
- asks for a database fixture with ``request.getfixturevalue()``, itself
  or in one of its fixtures;
- is not a plain test function (a doctest, another plugin's item).

Everything else is database-independent: pytest-django refuses a database
query in a test that asked for none ("Database access not allowed"), so a
test that passes in the SQLite pass without these never touched a database
in this process. When in doubt the rule keeps the test.

The SQLite pass is then the only one that runs those tests: with
IDEMPOTENCY_REQUIRE_SERVICES=1 (CI) a database-independent test that skips
itself there fails the pass, as a skipped PostgreSQL test fails the
PostgreSQL pass (tests/conftest.py).
"""

from __future__ import annotations

import inspect
import os
import re
from collections.abc import Generator

import pytest

OPTION = "--database-tests-only"
REQUIRE_SERVICES = os.environ.get("IDEMPOTENCY_REQUIRE_SERVICES") == "1"

#: Markers that say a test reaches a database.
DATABASE_MARKERS = frozenset({"django_db", "postgres", "live", "fleet", "database"})

#: pytest-django's fixtures that open, unblock or count the database.
DATABASE_FIXTURES = frozenset(
    {
        "db",
        "transactional_db",
        "django_db_setup",
        "django_db_blocker",
        "django_db_reset_sequences",
        "django_db_serialized_rollback",
        "django_db_createdb",
        "django_db_keepdb",
        "django_db_modify_db_settings",
        "live_server",
        "admin_user",
        "admin_client",
        "django_user_model",
        "django_assert_num_queries",
        "django_assert_max_num_queries",
        "django_capture_on_commit_callbacks",
    }
)

#: Markers under which a test may be skipped or fail in one pass and not another.
CONDITIONAL_MARKERS = frozenset({"skip", "skipif", "xfail", "not_under", "only_under"})


#: Words in a test's own code that say it looks at the database it runs on.
NAMES_THE_DATABASE = re.compile(r"\b(connections?|vendor|DATABASES|ENGINE|DATABASE_URL)\b")


def uses_database(item: pytest.Item) -> bool:
    """Whether ``item`` may reach a database (and so runs in every pass)."""
    if not isinstance(item, pytest.Function):
        return True
    markers = {marker.name for marker in item.iter_markers()}
    if markers & (DATABASE_MARKERS | CONDITIONAL_MARKERS):
        return True
    if getattr(item.cls, "databases", None):
        return True
    source = _source(item.function)
    if source is None or NAMES_THE_DATABASE.search(source) or _asks_for_the_database(source):
        return True
    return _reaches_database_fixture(item)


def _source(function: object) -> str | None:
    try:
        return inspect.getsource(function)  # type: ignore[arg-type]
    except (OSError, TypeError):
        return None


def _asks_for_the_database(source: str) -> bool:
    asked = re.findall(r"getfixturevalue\(\s*[\"'](\w+)[\"']", source)
    return bool(DATABASE_FIXTURES.intersection(asked))


def _reaches_database_fixture(item: pytest.Function) -> bool:
    """Whether a fixture the test or the suite asks for depends on a database fixture.

    pytest-django's own autouse fixtures all depend on ``django_db_blocker``
    (to keep the database blocked), so its fixtures are not followed: only
    what the suite's tests and fixtures ask for counts.
    """
    definitions = item._fixtureinfo.name2fixturedefs
    seen: set[str] = set()
    pending = list(item._fixtureinfo.initialnames)
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in DATABASE_FIXTURES:
            return True
        chain = definitions.get(name)
        if not chain or _is_pytest_django(chain[-1]):
            continue
        if _asks_for_the_database(_source(chain[-1].func) or ""):
            return True
        pending.extend(chain[-1].argnames)
    return False


def _is_pytest_django(definition: pytest.FixtureDef[object]) -> bool:
    return getattr(definition.func, "__module__", "").startswith("pytest_django")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        OPTION,
        action="store_true",
        help="deselect the tests that reach no database (tests/selection.py): "
        "for the PostgreSQL and MariaDB passes, which the SQLite pass spares them",
    )


_DESELECTED = pytest.StashKey[int]()
#: The database-independent tests of a run that keeps them, and those that skipped.
_INDEPENDENT = pytest.StashKey[set[str]]()
_SKIPPED = pytest.StashKey[list[str]]()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    independent = [item for item in items if not uses_database(item)]
    if not config.getoption(OPTION):
        config.stash[_INDEPENDENT] = {item.nodeid for item in independent}
        config.stash[_SKIPPED] = []
        return
    if independent:
        config.hook.pytest_deselected(items=independent)
        kept = set(map(id, items)) - set(map(id, independent))
        items[:] = [item for item in items if id(item) in kept]
    config.stash[_DESELECTED] = len(independent)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.skipped and item.nodeid in item.config.stash.get(_INDEPENDENT, set()):
        item.config.stash[_SKIPPED].append(item.nodeid)
    return report


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    count = terminalreporter.config.stash.get(_DESELECTED, None)
    if count is not None:
        terminalreporter.write_line(
            f"{OPTION}: {count} database-independent tests deselected (no database "
            "fixture, marker or name in their code; the SQLite pass runs them)"
        )


def pytest_sessionfinish(session: pytest.Session) -> None:
    skipped = session.config.stash.get(_SKIPPED, [])
    if not (REQUIRE_SERVICES and skipped and _database_is_sqlite()):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(
            f"IDEMPOTENCY_REQUIRE_SERVICES=1: {len(skipped)} database-independent test(s) "
            "skipped in the SQLite pass, the only pass that runs them:",
            red=True,
        )
        for nodeid in skipped:
            reporter.write_line(f"  {nodeid}", red=True)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _database_is_sqlite() -> bool:
    from django.db import connections

    return bool(connections["default"].vendor == "sqlite")
