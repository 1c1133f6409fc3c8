# The two commands of the README's quick start. Each creates the virtualenv
# it needs (.venv) and installs the package with its test dependencies.
PYTHON ?= python3
VENV ?= .venv

.PHONY: demo test lint clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet --editable ".[test,lint]"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/python testproject/demo.py

test: $(VENV)/.installed
	$(VENV)/bin/python runtests.py $(PYTEST_ARGS)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy django_idempotency

clean:
	rm -rf $(VENV) build dist *.egg-info tests/*.sqlite3* testproject/*.sqlite3*
