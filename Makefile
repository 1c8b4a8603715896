# `make demo` trains the example on real data; `make test` runs the test suite; `make check` runs the linters,
# the strict type check, the import contracts, the docs build and a check of the built pages (CI runs it before
# `make test`).
# Each creates the virtual environment it needs (.venv) with the CPU build of torch pinned in constraints.txt.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test check docs bench notebook clean

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[test,examples,docs]"
	touch $@

demo: $(VENV)/.installed
	$(PY) examples/train_digits.py

# three test processes: most tests wait on workers, subprocesses, timeouts or grace periods, so even two
# cores run three files at once; --dist loadfile keeps a file's module fixtures (the entry-point matrix)
# in one process
test: $(VENV)/.installed
	$(PY) -m compileall -q mplaunch tests > /dev/null  # (even under PYTHONDONTWRITEBYTECODE=1: each interpreter the suite starts loads them)
	$(PY) -m pytest -n 3 --dist loadfile

check: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check mplaunch tests benchmarks examples
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	site=$$(mktemp -d) && $(VENV)/bin/mkdocs build --strict --site-dir $$site && $(PY) scripts/check_site.py $$site; \
		status=$$?; rm -rf $$site; exit $$status

docs: $(VENV)/.installed
	$(VENV)/bin/mkdocs serve

bench: $(VENV)/.installed
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[test,bench]"
	$(PY) benchmarks/run.py --quick

clean:
	rm -rf $(VENV) .pytest_cache *.egg-info site
