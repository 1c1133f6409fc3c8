"""The parts of benchmarks/request_costs.py: what one request costs, counted.

* ``cells``: the designs, the kinds of request and how each is sent
  (Django's test client, in this process);
* ``own_server``: the PostgreSQL server of the script's own;
* ``wire``: a relay between Django and PostgreSQL that counts round trips;
* ``writes``: the catalog's tables and indexes, and what the WAL says was
  written to them;
* ``counting``: the counting pass (round trips, statements, rows, index
  entries, WAL bytes);
* ``loop``: the loops run under callgrind (a process of their own);
* ``instructions``: runs that process under valgrind and reads its dumps;
* ``targets``: the release's deterministic targets, judged;
* ``report``: the table, the targets and docs/performance.md's block.
"""
