# `make demo` trains the example on real data; `make test` runs the test suite.
# Each creates the virtual environment it needs (.venv) with the CPU build of torch pinned in constraints.txt.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test bench notebook clean

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[test,examples]"
	touch $@

demo: $(VENV)/.installed
	$(PY) examples/train_digits.py

test: $(VENV)/.installed
	$(PY) -m pytest

bench: $(VENV)/.installed
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[test,bench]"
	$(PY) benchmarks/run.py --quick

clean:
	rm -rf $(VENV) .pytest_cache *.egg-info
