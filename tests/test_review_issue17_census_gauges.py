"""Review of issue 17: the census gauges under Celery's default (prefork) pool.

docs/observability.md: "one process takes them: the Celery task
observe_records ... It sets the gauges in the worker that runs it; with the
OpenTelemetry sink, that worker's SDK exports them." Celery's default pool
is prefork: each run of the task lands in one of several child processes,
and each child's SDK keeps exporting the last values that child set (a
synchronous gauge, cumulative temporality: the last value is kept). The
alert rules read the gauges with ``max by (database)``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from datetime import timedelta

import pytest

from django_idempotency.models import IdempotencyRecord
from tests.test_health_command import aged, database_url, make
from tests.test_review_issue17_prometheus import REPO

pytestmark = pytest.mark.django_db(transaction=True)
State = IdempotencyRecord.State

#: A worker child: runs observe_records when told to, reports what its SDK exports.
CHILD = textwrap.dedent(
    """
    import json, sys
    import django
    django.setup()
    from opentelemetry import metrics
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from django_idempotency._observability import opentelemetry as metrics_opentelemetry
    from django_idempotency.tasks import observe_records
    metrics_opentelemetry.CENSUS_REPORTED_FOR = 1.0  # 150 s in production
    reader = InMemoryMetricReader()
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))

    def exported():
        found = {}
        data = reader.get_metrics_data()
        for resource in data.resource_metrics if data else ():
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    for point in metric.data.data_points:
                        labels = dict(point.attributes)
                        if labels.get("state") == "UNCERTAIN":
                            found[metric.name] = point.value
        return found

    for line in sys.stdin:
        if line.strip() == "census":
            observe_records.run()
        print(json.dumps(exported()), flush=True)
    """
)


class Child:
    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", CHILD],
            cwd=REPO,
            env={
                **os.environ,
                "DATABASE_URL": database_url(),
                "DJANGO_SETTINGS_MODULE": "tests.settings",
                "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            },
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def ask(self, what: str) -> dict[str, float]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(what + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        assert line, "the child process died"
        return dict(json.loads(line))

    def close(self) -> None:
        with self.process:  # closes the pipes, then waits for the process
            assert self.process.stdin is not None
            self.process.stdin.close()


def test_a_resolved_uncertain_record_stops_showing_in_what_the_worker_exports() -> None:
    """Child A's census saw an UNCERTAIN record 20 minutes old; an operator resolved
    it; child B's census (the next minute) saw none. What the workers export,
    read as the alerts read it (``max by (database)``), must be the latest
    census: it is A's stale one, which A keeps exporting until the task
    happens to land on A again, so ``IdempotencyUncertainRecordsOld`` keeps
    firing for a record that is gone. (Fixed: a process reports its census
    for ``CENSUS_REPORTED_FOR`` only, shortened here.)
    """
    stuck = aged(make(State.UNCERTAIN), created_at=timedelta(minutes=20))
    first, second = Child(), Child()
    try:
        assert first.ask("census")["idempotency.records"] == 1
        IdempotencyRecord.objects.filter(pk=stuck.pk).update(state=State.FAILED)
        assert second.ask("census")["idempotency.records"] == 0

        time.sleep(1.2)  # A's census is past CENSUS_REPORTED_FOR; B takes the next one
        exports = [first.ask("collect"), second.ask("census")]
    finally:
        first.close()
        second.close()

    for name in ("idempotency.records", "idempotency.oldest_unresolved.age"):
        assert max(export.get(name, 0) for export in exports) == 0, (name, exports)
