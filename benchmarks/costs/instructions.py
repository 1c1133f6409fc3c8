"""Instructions per request: benchmarks/costs/loop.py under callgrind, its dumps read.

Each run gets a fresh database (so that ids, keys, table and index sizes
are the same from run to run), ``PYTHONHASHSEED=0`` and, as root, the same
process id (``same_pid``). What callgrind
counts is every instruction the process executes in user space: Python,
Django, DRF, the package, the test client, psycopg and libpq; not the
kernel's, not PostgreSQL's.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from benchmarks.benchlib import REPO_ROOT, Database, django_env, migrate

_TOTAL = re.compile(r"^(?:summary|totals): (\d+)", re.MULTILINE)


@dataclass
class Loops:
    """The instructions of a cell's two loops."""

    short: int
    long: int


def valgrind_version() -> str:
    if shutil.which("valgrind") is None:
        return ""
    return subprocess.run(
        ["valgrind", "--version"], capture_output=True, text=True, check=False
    ).stdout.strip()


def same_pid() -> list[str]:
    """As root, the command that runs the process as PID 1 of a PID namespace of its own.

    The process id ends up in strings the package builds (a claim's lease
    owner is host:pid:thread), and a string one digit longer moves every
    object allocated after it: objects hashed by address then collide
    differently in dictionaries, and a loop's instructions move by up to
    half a percent from run to run. With the same PID in every run they do
    not.
    """
    if os.geteuid() == 0 and shutil.which("unshare"):
        return ["unshare", "--pid", "--fork", "--kill-child"]
    return []


def dump_total(path: Path) -> int:
    found = _TOTAL.search(path.read_text(errors="replace"))
    if found is None:
        raise RuntimeError(f"{path}: no summary line")
    return int(found[1])


def run(
    server_url: str,
    variants: list[str],
    warmup: int,
    short: int,
    long: int,
    keep: Path | None = None,
    shift: int = 0,
) -> dict[str, Loops]:
    """One run under callgrind on a fresh database: each cell's two loops, in instructions.

    ``keep``: a folder to copy each loop's callgrind dump to (``callgrind_annotate`` reads
    them: which C functions the interpreter spent the loop in). ``shift``: how far to
    move the heap before anything else is allocated (``loop.shift_heap``).
    """
    if shutil.which("valgrind") is None:
        raise RuntimeError("valgrind is not installed (Debian: apt-get install valgrind)")
    with (
        Database(server_url, "idem_bench_costs_cg") as database,
        tempfile.TemporaryDirectory(prefix="idem-callgrind-") as scratch,
    ):
        migrate(database)
        folder = Path(scratch)
        spec = folder / "spec.json"
        layout = folder / "layout.json"
        spec.write_text(
            json.dumps(
                {
                    "variants": variants,
                    "warmup": warmup,
                    "short": short,
                    "long": long,
                    "layout": str(layout),
                    "shift": shift,
                }
            )
        )
        out = folder / "cg.out"
        command = [
            *same_pid(),
            "valgrind", "--tool=callgrind", "--dump-before=getloadavg",
            f"--callgrind-out-file={out}", "--dump-line=no", "--compress-pos=yes",
            sys.executable, "-m", "benchmarks.costs.loop", str(spec),
        ]  # fmt: skip
        env = {**django_env(database), "PYTHONHASHSEED": "0"}
        result = subprocess.run(
            command,
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=3600,
            check=False,
        )
        if result.returncode != 0 or not layout.exists():
            raise RuntimeError(
                f"the loops under callgrind failed ({result.returncode}):\n"
                f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
            )
        markers: list[str] = json.loads(layout.read_text())
        # Dump n (cg.out.n) holds what ran from marker n-1 (or the start) to marker n.
        totals = {
            name: dump_total(out.with_name(f"cg.out.{number}"))
            for number, name in enumerate(markers, start=1)
        }
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            for number, name in enumerate(markers, start=1):
                cell, loop, edge = name.split("|")
                if edge == "end":
                    target = keep / f"{cell.replace(', ', '-').replace(' ', '-')}.{loop}.callgrind"
                    shutil.copy(out.with_name(f"cg.out.{number}"), target)
    loops: dict[str, Loops] = {}
    for name, total in totals.items():
        cell, loop, edge = name.split("|")
        if edge != "end":
            continue
        found = loops.setdefault(cell, Loops(0, 0))
        if loop == "a":
            found.short = total
        else:
            found.long = total
    return loops


def per_request(loops: Loops, short: int, long: int) -> float:
    return (loops.long - loops.short) / (long - short)
