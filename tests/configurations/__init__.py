"""Real-project configurations under which the guarantee tests run.

The suite's own settings (``tests/settings.py``) are one idealised project.
Each configuration here is a small function that turns them into a project
configured the way real ones are (an audit app's delete receivers,
persistent connections, another isolation level, ``ATOMIC_REQUESTS``, ...).
``tests/settings.py`` applies the one named by the environment variable
``IDEMPOTENCY_TEST_CONFIGURATION`` at its end, so the pytest process, the
live gunicorn servers and the ``migrate`` they run all see the same project.

``runtests.py --configurations`` runs every (configuration, database) cell
of the guarantee tests (``-m guarantees``) as a pytest process of its own.
Tests whose behaviour a configuration changes on purpose say so with
``@pytest.mark.not_under(name, reason=...)``; tests meaningful only under a
configuration with ``@pytest.mark.only_under(name)`` (``plugin.py``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

ENVIRONMENT_VARIABLE = "IDEMPOTENCY_TEST_CONFIGURATION"
#: The databases a cell can run on, as ``runtests.py`` names them.
DATABASES = ("sqlite", "postgres", "mariadb")

Settings = MutableMapping[str, Any]

#: The guarantee tests that run in the test process (pytest-django's database).
IN_PROCESS = (
    "tests/test_behaviour.py",
    "tests/test_optimistic.py",
    "tests/test_transactions.py",
    "tests/test_external.py",
    "tests/test_recovery.py",
    "tests/test_tenant_isolation.py",
    "tests/test_testing_helpers.py",
    "tests/test_configurations.py",
)
#: Races over real gunicorn processes (PostgreSQL cells).
LIVE = ("tests/live/test_concurrency.py", "tests/live/test_configurations_live.py")
#: The demo project's crash and fencing tests (a Celery worker, the provider).
CRASHES = ("tests/live/test_crashes.py",)


@dataclass(frozen=True)
class Configuration:
    name: str
    #: What real projects do that this configuration reproduces (docs, summary).
    summary: str
    adjust: Callable[[Settings], None]
    databases: tuple[str, ...] = DATABASES
    #: Test paths per database; live tests only where PostgreSQL serves them.
    in_process: tuple[str, ...] = IN_PROCESS
    live: tuple[str, ...] = ()
    #: Extra environment of the cell's pytest process (inherited by its servers).
    environment: Mapping[str, str] = field(default_factory=dict)
    #: A command the cell's pytest process runs under (``faketime``).
    wrapper: tuple[str, ...] = ()
    #: In the default run (``runtests.py --configurations`` without names).
    default: bool = True

    def paths(self, database: str) -> tuple[str, ...]:
        return self.in_process + (self.live if database == "postgres" else ())


def _vendor(settings: Settings) -> str:
    engine = str(settings["DATABASES"]["default"]["ENGINE"])
    return engine.rsplit(".", 1)[-1]


def _idempotency(settings: Settings, **values: Any) -> None:
    settings["IDEMPOTENCY"] = {**settings.get("IDEMPOTENCY", {}), **values}


# -- the configurations ---------------------------------------------------------------


def baseline(settings: Settings) -> None:
    """The suite's own settings, unchanged: the reference row of the table."""


def delete_signals(settings: Settings) -> None:
    settings["INSTALLED_APPS"] = [*settings["INSTALLED_APPS"], "tests.configurations.audit"]


def persistent_connections(settings: Settings) -> None:
    default = settings["DATABASES"]["default"]
    default["CONN_MAX_AGE"] = 600
    default["CONN_HEALTH_CHECKS"] = True


def repeatable_read(settings: Settings) -> None:
    options = settings["DATABASES"]["default"].setdefault("OPTIONS", {})
    if _vendor(settings) == "postgresql":
        from psycopg import IsolationLevel

        options["isolation_level"] = IsolationLevel.REPEATABLE_READ
    elif _vendor(settings) == "mysql":
        # InnoDB's own default, which Django replaces with READ COMMITTED
        # unless told otherwise: what many MariaDB projects run.
        options["isolation_level"] = "repeatable read"


def atomic_requests(settings: Settings) -> None:
    settings["DATABASES"]["default"]["ATOMIC_REQUESTS"] = True


def csrf_real_server(settings: Settings) -> None:
    # CsrfViewMiddleware is in the suite's MIDDLEWARE already; Django's test
    # client skips its checks, so this configuration's tests post with
    # tokens over a real server (tests/live/test_configurations_live.py) and
    # with ``Client(enforce_csrf_checks=True)`` (tests/test_configurations.py).
    assert "django.middleware.csrf.CsrfViewMiddleware" in settings["MIDDLEWARE"]
    settings["ROOT_URLCONF"] = "tests.configurations.forms"


def naive_new_york(settings: Settings) -> None:
    settings["USE_TZ"] = False
    settings["TIME_ZONE"] = "America/New_York"


def fail_open(settings: Settings) -> None:
    _idempotency(settings, FAIL_OPEN=True)


#: Two Fernet keys (newest first), fixed so that servers and tests agree.
ENCRYPTION_KEYS = (
    "3Curi30a91CTJvp6EQRirB6a7b6LQhz3tXff1uSgj6E=",
    "43cVNL0pVTAE_mTK6y9FIO5jEZJdXybhfo6yneDOmIo=",
)


def encryption(settings: Settings) -> None:
    _idempotency(settings, ENCRYPTION_KEYS=list(ENCRYPTION_KEYS))


def uuid_user(settings: Settings) -> None:
    # The user app must come before the apps whose migrations point at
    # AUTH_USER_MODEL (rest_framework.authtoken, payments).
    apps = list(settings["INSTALLED_APPS"])
    apps.insert(apps.index("django.contrib.auth") + 1, "tests.configurations.uuid_user")
    settings["INSTALLED_APPS"] = apps
    settings["AUTH_USER_MODEL"] = "uuid_user.User"


def browsable_api(settings: Settings) -> None:
    settings["REST_FRAMEWORK"] = {
        **settings["REST_FRAMEWORK"],
        "DEFAULT_RENDERER_CLASSES": [
            "rest_framework.renderers.JSONRenderer",
            "rest_framework.renderers.BrowsableAPIRenderer",
        ],
    }


def read_replica_router(settings: Settings) -> None:
    default = settings["DATABASES"]["default"]
    settings["DATABASES"]["replica"] = {
        **default,
        "TEST": {**default.get("TEST", {}), "MIRROR": "default"},
    }
    settings["DATABASE_ROUTERS"] = ["tests.configurations.routers.ReadReplicaRouter"]


#: gunicorn's threaded worker: several requests of one process at once, each
#: thread with its own Django connections (and its own second connection for
#: begin_external()). Read by tests/live/server.py.
GTHREAD = {
    "IDEMPOTENCY_TEST_GUNICORN_WORKER_CLASS": "gthread",
    "IDEMPOTENCY_TEST_GUNICORN_THREADS": "4",
}

#: Where the live servers run instead of PostgreSQL (tests/live/server.py);
#: ``{mariadb}`` is replaced by the runner with the MariaDB URL.
LIVE_MARIADB = "IDEMPOTENCY_TEST_LIVE_MARIADB_URL"

#: Set by the PgBouncer cell: every live database behind a PgBouncer of its
#: own in transaction pooling (tests/live/server.py, tests/live/pgbouncer.py).
LIVE_PGBOUNCER = "IDEMPOTENCY_TEST_LIVE_PGBOUNCER"
#: The intents' pool the live harness gives the app processes, when it does.
INTENT_DATABASE_URL = "IDEMPOTENCY_TEST_INTENT_DATABASE_URL"
#: What the PgBouncer cell runs: the race (50 x 20), the crash points with
#: the Celery worker's recovery. The begin_external() pool deadlock, the
#: state leaks, prepared statements, the recover and purge commands are
#: tests/live/test_pgbouncer.py, in every `make test`.
LIVE_PGBOUNCER_PATHS = (
    "tests/live/test_concurrency.py",
    *CRASHES,
)

#: Just before the spring-forward change in New York (02:00 EST -> 03:00 EDT).
DST_MOMENT = "2027-03-14 01:59:30"


CONFIGURATIONS: dict[str, Configuration] = {
    configuration.name: configuration
    for configuration in (
        # Not in the default run: `make test` runs these tests on these settings.
        Configuration(
            "baseline", "the suite's own settings (reference row)", baseline, default=False
        ),
        Configuration(
            "delete-signals",
            "an installed app connects pre_delete/post_delete receivers without a sender "
            "(audit and history packages)",
            delete_signals,
            live=LIVE + CRASHES,
        ),
        Configuration(
            "persistent-connections",
            "CONN_MAX_AGE=600 with CONN_HEALTH_CHECKS=True",
            persistent_connections,
            databases=("postgres", "mariadb"),
            live=LIVE,
        ),
        Configuration(
            "repeatable-read",
            "REPEATABLE READ: PostgreSQL OPTIONS isolation_level (psycopg IsolationLevel); "
            "MariaDB's InnoDB default",
            repeatable_read,
            databases=("postgres", "mariadb"),
            live=LIVE + CRASHES,
        ),
        Configuration(
            "atomic-requests",
            "ATOMIC_REQUESTS=True, with TestCase and django_db tests",
            atomic_requests,
            live=LIVE,
        ),
        Configuration(
            "csrf-real-server",
            "CsrfViewMiddleware enforcing on plain views: multipart and urlencoded POSTs "
            "with a token, over a real server",
            csrf_real_server,
            databases=("sqlite", "postgres"),
            in_process=("tests/test_configurations.py",),
            live=("tests/live/test_configurations_live.py",),
        ),
        Configuration(
            "gthread",
            "gunicorn gthread workers (2 processes x 4 threads): threads share a process "
            "and each has its own second connection",
            baseline,
            databases=("postgres",),
            in_process=(),
            live=LIVE,
            environment={**GTHREAD, "IDEMPOTENCY_TEST_GUNICORN_WORKERS": "2"},
        ),
        Configuration(
            "gthread-persistent",
            "gthread workers with CONN_MAX_AGE=600 and CONN_HEALTH_CHECKS",
            persistent_connections,
            databases=("postgres",),
            in_process=(),
            live=LIVE,
            environment={**GTHREAD, "IDEMPOTENCY_TEST_GUNICORN_WORKERS": "2"},
        ),
        Configuration(
            "live-on-mariadb",
            "the live races with gunicorn on MariaDB (PyMySQL, Django's READ COMMITTED); "
            "the test process, on PostgreSQL, only drives them",
            baseline,
            databases=("postgres",),
            in_process=(),
            live=("tests/live/test_concurrency.py",),
            environment={LIVE_MARIADB: "{mariadb}"},
        ),
        Configuration(
            "live-on-mariadb-repeatable-read",
            "the same with MariaDB at REPEATABLE READ (InnoDB's default)",
            repeatable_read,
            databases=("postgres",),
            in_process=(),
            live=("tests/live/test_concurrency.py",),
            environment={LIVE_MARIADB: "{mariadb}"},
        ),
        Configuration(
            "pgbouncer-transaction-pooling",
            "the live processes reach PostgreSQL through PgBouncer in transaction pooling "
            "(pools of 3, smaller than the clients; begin_external()'s intents in a pool "
            "of their own, INTENT_DATABASES)",
            baseline,
            databases=("postgres",),
            in_process=(),
            live=LIVE_PGBOUNCER_PATHS,
            environment={LIVE_PGBOUNCER: "1"},
        ),
        Configuration(
            "naive-new-york",
            "USE_TZ=False with TIME_ZONE='America/New_York'",
            naive_new_york,
        ),
        Configuration(
            "dst-naive",
            f"USE_TZ=False in New York, the process started under faketime at {DST_MOMENT} "
            "local, a minute before the spring-forward change",
            naive_new_york,
            databases=("sqlite", "postgres"),
            in_process=("tests/test_configurations.py",),
            environment={"TZ": "America/New_York"},
            wrapper=("faketime", DST_MOMENT),
        ),
        Configuration("fail-open", "IDEMPOTENCY FAIL_OPEN=True", fail_open, live=LIVE),
        Configuration(
            "encryption", "IDEMPOTENCY ENCRYPTION_KEYS set (two Fernet keys)", encryption
        ),
        Configuration(
            "uuid-user",
            "AUTH_USER_MODEL with a UUID primary key (its own app and migration)",
            uuid_user,
            databases=("sqlite", "postgres"),
        ),
        Configuration(
            "browsable-api",
            "DRF's BrowsableAPIRenderer in DEFAULT_RENDERER_CLASSES, requests with "
            "Accept: text/html too",
            browsable_api,
            databases=("sqlite", "postgres"),
        ),
        Configuration(
            "read-replica-router",
            "a second alias (a replica, TEST MIRROR of default) and a router sending reads to it",
            read_replica_router,
            databases=("postgres",),
            # Unfinished: in django_db tests the replica alias is a second
            # connection that does not see the test's uncommitted rows.
            default=False,
        ),
    )
}


#: The configurations that can change what the optimistic mode does (its
#: transaction's isolation, the request's transaction, the clock it writes
#: expiry with, a receiver on its DELETE): its guarantee tests run there,
#: and in the baseline; elsewhere they would repeat the default mode's.
OPTIMISTIC_MODE = frozenset(
    {"baseline", "repeatable-read", "atomic-requests", "naive-new-york", "delete-signals"}
)


def active() -> str:
    """The configuration this process runs under (``baseline`` when none is named)."""
    return os.environ.get(ENVIRONMENT_VARIABLE) or "baseline"


def apply(settings: Settings) -> None:
    """Apply the configuration named by ``IDEMPOTENCY_TEST_CONFIGURATION`` to ``settings``."""
    name = active()
    try:
        configuration = CONFIGURATIONS[name]
    except KeyError:
        raise RuntimeError(
            f"{ENVIRONMENT_VARIABLE}={name!r} names no configuration; "
            f"known: {', '.join(CONFIGURATIONS)}"
        ) from None
    configuration.adjust(settings)
    intent_database_from_environment(settings)


def intent_database_from_environment(settings: Settings) -> None:
    """An ``intents`` alias and ``INTENT_DATABASES`` where the live harness gives a pool.

    The live servers behind PgBouncer get the URL of a second database entry
    of the same database (``IDEMPOTENCY_TEST_INTENT_DATABASE_URL``): the
    intents of ``begin_external()`` commit through a pool of their own.
    """
    url = os.environ.get(INTENT_DATABASE_URL)
    if not url:
        return
    import dj_database_url

    default = settings["DATABASES"]["default"]
    settings["DATABASES"]["intents"] = {
        **default,
        **dj_database_url.parse(url),
        # Only the package writes there, never a view's request transaction.
        "ATOMIC_REQUESTS": False,
        "TEST": {**default.get("TEST", {}), "MIRROR": "default"},
    }
    _idempotency(settings, INTENT_DATABASES={"default": "intents"})
