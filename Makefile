# The two commands of the README's quick start. Each creates the virtualenv
# it needs (.venv) and installs the package with its test dependencies.
PYTHON ?= python3
VENV ?= .venv

.PHONY: demo test configurations fleet lint precommit docs settings-reference dist-check matrix matrix-ci \
	matrix-ci-envs matrix-ci-run clean request-costs

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet --editable ".[test,lint]"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/python testproject/demo.py

# Under coverage, with the gate of pyproject.toml's [tool.coverage.report]
# (judged when the whole suite ran on all three databases). The tests that
# reach no database run in the SQLite pass only (tests/selection.py).
test: $(VENV)/.installed
	$(VENV)/bin/python runtests.py --coverage $(PYTEST_ARGS)

# The configuration matrix (tests/configurations/): the guarantee tests under
# each real-project configuration, on each database it applies to (those
# that reach no database in the configuration's first cell only), one
# pytest process per cell, two cells at a time. CONFIGURATIONS=name... to
# pick some; the dst-naive cell needs Debian's `faketime`.
configurations: $(VENV)/.installed
	$(VENV)/bin/python runtests.py --configurations $(CONFIGURATIONS) $(PYTEST_ARGS)

# The fleet (tests/fleet/): hosts in network namespaces behind a resending
# load balancer, a partition, a failover to a promoted standby. Needs root
# (namespaces), iproute2, nginx and PostgreSQL's server binaries; bounded to
# a few minutes. Not part of `make test`: each pass would repeat it.
fleet: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -m fleet tests/fleet $(PYTEST_ARGS)

# mypy checks the tests and the demo project as strictly as the package;
# lint-imports checks the architecture (pyproject.toml's [tool.importlinter]).
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy django_idempotency tests testproject conftest.py runtests.py
	$(VENV)/bin/lint-imports --no-cache

# Every hook of .pre-commit-config.yaml (ruff, ruff-format, django-upgrade,
# typos) on every file; the hooks' environments come from PyPI on first use.
precommit: $(VENV)/.installed
	$(VENV)/bin/pre-commit run --all-files --show-diff-on-failure

# Rewrite the generated reference of docs/settings.md from the declarations
# in django_idempotency/conf.py (tests/test_conf.py fails while they differ).
settings-reference: $(VENV)/.installed
	$(VENV)/bin/python scripts/settings_reference.py

# What one request costs, counted (benchmarks/request_costs.py): round trips,
# statements, rows and index entries written, WAL bytes, and instructions
# under callgrind, for the unprotected view, the hand-written floors and both
# modes of the package, against the 1.0.0rc1 baseline (benchmarks/figures/);
# rewrites the table of docs/performance.md's "Per request, counted". Needs
# PostgreSQL's server binaries (it starts a server of its own) and valgrind;
# about 10 minutes.
request-costs: $(VENV)/.installed
	$(VENV)/bin/python benchmarks/request_costs.py --write-docs $(REQUEST_COSTS_ARGS)

# The documentation site (mkdocs.yml), warnings as errors.
docs: $(VENV)/.installed
	$(VENV)/bin/python -m pip install --quiet --editable ".[docs]"
	$(VENV)/bin/mkdocs build --strict --site-dir site

# The whole support matrix (tox.ini), and the representative cells CI runs
# on top of `make test`: newer Djangos on newer Pythons, one cell per
# database (the live multi-process tests already ran in `make test`), two
# at a time: each uses its own database server or file. Every cell runs the
# tests that reach no database too: each is the only cell of its Python or
# its Django, where those tests (imports, docs, packaging) can still fail.
# pyenv's interpreters, when present, so that tox finds python3.12 and 3.13.
# The integrations' live tests (worker processes, uvicorn, gunicorn behind a
# faulty proxy), which `make test` runs on Django 5.2: on the newest Django
# too, so that each integration is tested on the oldest and newest Django of
# the matrix on PostgreSQL.
INTEGRATIONS_LIVE := tests/live/test_tasks_framework_workers.py tests/live/test_asgi.py \
	tests/live/test_client_recipe_live.py
PYENV_BINS := $(subst $(eval) ,:,$(wildcard $(HOME)/.pyenv/versions/3.1[123]*/bin))
TOX := PATH="$(PYENV_BINS):$$PATH" $(VENV)/bin/tox

matrix: $(VENV)/.installed
	$(VENV)/bin/python -m pip install --quiet tox
	$(TOX) run-parallel --parallel 2

# matrix-ci in two steps, so that CI can make the environments while
# `make test` runs: matrix-ci-envs makes the cells' environments and
# installs the package in them (tox --notest), matrix-ci-run runs the cells
# in them as they are (--skip-env-install). Beside the three cells (two at a
# time), the integrations' live tests run in the PostgreSQL cell's
# environment: they mostly wait on their workers and servers.
MATRIX_CI_CELLS := py312-django61-postgres,py313-django60-mariadb,py313-django61-sqlite
MATRIX_CI_LOG := .tox/matrix-ci-integrations-live.log

matrix-ci: matrix-ci-envs
	$(MAKE) matrix-ci-run

matrix-ci-envs: $(VENV)/.installed
	$(VENV)/bin/python -m pip install --quiet tox
	$(TOX) run-parallel --parallel 2 --parallel-no-spinner --skip-missing-interpreters false \
		--notest -e $(MATRIX_CI_CELLS)

matrix-ci-run: $(VENV)/.installed
	mkdir -p .tox
	$(TOX) run --skip-env-install --skip-missing-interpreters false \
		-e py312-django61-postgres -- -q $(INTEGRATIONS_LIVE) >$(MATRIX_CI_LOG) 2>&1 & live=$$!; \
	$(TOX) run-parallel --skip-env-install --parallel 2 --parallel-no-spinner \
		--skip-missing-interpreters false -e $(MATRIX_CI_CELLS) -- -m "not live" -q; cells=$$?; \
	wait $$live; code=$$?; \
	echo "===== the integrations' live tests, py312-django61-postgres ====="; \
	cat $(MATRIX_CI_LOG); \
	test $$cells -eq 0 && test $$code -eq 0

clean:
	rm -rf $(VENV) build dist *.egg-info tests/*.sqlite3* testproject/*.sqlite3*

# Build the wheel and sdist; check them (twine check, and the wheel holds
# the package with its private subpackages, migrations, templates and
# py.typed, and nothing else of the repository: scripts/check_dist.py);
# install the wheel into a clean virtualenv and run a smoke test there,
# from outside the repository.
dist-check: $(VENV)/.installed
	rm -rf dist /tmp/django-idempotency-dist-check
	$(VENV)/bin/python -m pip install --quiet build twine
	$(VENV)/bin/python -m build --outdir dist .
	$(VENV)/bin/python scripts/check_dist.py dist
	$(PYTHON) -m venv /tmp/django-idempotency-dist-check
	/tmp/django-idempotency-dist-check/bin/python -m pip install --quiet dist/*.whl
	cd /tmp && /tmp/django-idempotency-dist-check/bin/python $(CURDIR)/scripts/smoke_installed.py
