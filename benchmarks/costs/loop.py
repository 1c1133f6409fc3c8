"""The loops callgrind counts: run as ``python -m benchmarks.costs.loop SPEC.json`` under valgrind.

For each cell, after a warm-up loop: a loop of ``short`` requests, then a
loop of ``long`` ones, each between two markers. A marker is a call of
``getloadavg()`` (``os.getloadavg``), which nothing else in the process
calls: valgrind runs with ``--dump-before=getloadavg``, so each marker
dumps the instructions counted since the previous one and starts again
from zero. The loop of ``long`` requests minus the loop of ``short``
requests, divided by ``long - short``, is what one request costs, whatever
a loop costs to start and end. Before each loop the tables are vacuumed
and analysed (as in the counting pass) and the heap is collected and
frozen (``gc.freeze()``), so that both loops start from the same state and
a full collection, whose cost depends on everything the process holds,
lands in neither by chance. Connections persist for the whole run
(``CONN_MAX_AGE`` None): no reconnection lands in a loop.

Writes SPEC's ``layout`` file: the markers in order, each named.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

import psycopg

#: What ``shift_heap`` allocated: kept alive for the whole run.
_SHIFT: list[object] = []


def shift_heap(amount: int) -> None:
    """Allocate objects of many sizes before anything else: everything after lands elsewhere.

    Where objects land decides how objects hashed by address (classes,
    functions, signal receivers...) collide in dictionaries, and so a few
    instructions per lookup. A change anywhere in the code moves them all,
    which moves the figures of cells whose code did not change by up to
    0.3 %; the runs are made each with another shift, so that their spread
    shows that noise and their mean averages it.
    """
    _SHIFT.extend(bytes(size) for size in range(1, 1 + 64 * amount))
    _SHIFT.extend(object() for _ in range(97 * amount))


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    shift_heap(spec["shift"])
    import django

    django.setup()
    from django.db import connections

    # Persistent for the whole run: the benchmark settings' CONN_MAX_AGE (600 s) would
    # reconnect in the middle of whichever loop runs when a slow run reaches it.
    connections.settings["default"]["CONN_MAX_AGE"] = None
    from benchmarks.costs.cells import Driver, cells, variants_named
    from benchmarks.costs.counting import vacuum

    driver_cells = cells(variants_named(spec["variants"]))
    driver = Driver(locker_url=os.environ["DATABASE_URL"])
    markers: list[str] = []

    def mark(name: str) -> None:
        os.getloadavg()
        markers.append(name)

    with psycopg.connect(os.environ["DATABASE_URL"], autocommit=True) as admin:
        for cell in driver_cells:
            with driver.ready(cell, "w", first_loop=True):
                driver.run(cell, "w", spec["warmup"])
            for loop, count in (("a", spec["short"]), ("b", spec["long"])):
                vacuum(admin)
                with driver.ready(cell, loop, first_loop=False):
                    gc.collect()
                    gc.freeze()
                    mark(f"{cell.name}|{loop}|start")
                    driver.run(cell, loop, count)
                    mark(f"{cell.name}|{loop}|end")
    connections.close_all()
    Path(spec["layout"]).write_text(json.dumps(markers))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
