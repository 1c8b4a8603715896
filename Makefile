# `make demo` trains the example on real data; `make test` runs the test suite; `make check` runs the linters,
# the strict type check, the import contracts, the docs build and a check of the built pages (CI runs it before
# `make test`).
# Each creates the virtual environment it needs (.venv) with the CPU build of torch pinned in constraints.txt.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test check docs bench notebook clean gpu-check test-cuda-build

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

# The torch that `pip install torch` gives on Linux, and the newest supported: its CUDA build (no GPU needed),
# in a virtual environment of its own (about 5 GB, 1.5 minutes from the local wheel files). There a bare
# torch.cuda.is_available() marks every forked child, GPU or not. It runs the unit tests, the launches from
# inside forked ranks, the multi-node files and the demo (`make test` runs all on the oldest, pinned above).
CUDA_VENV ?= .venv-cuda
TORCH_NEWEST ?= 2.14.1
FORKED_LAUNCHES := launch_its_own or inside_a_fork or launch_it_made or pool or inside_a_gloo_rank or inside_rank

$(CUDA_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(CUDA_VENV)
	$(CUDA_VENV)/bin/python -m pip install --quiet --disable-pip-version-check "torch==$(TORCH_NEWEST)" -e ".[test,examples]"
	touch $@

test-cuda-build: $(CUDA_VENV)/.installed
	$(CUDA_VENV)/bin/python -m pytest -n 3 --dist loadfile -p no:cacheprovider tests/unit tests/integration/test_multinode.py \
		tests/integration/test_multinode_preemption.py
	$(CUDA_VENV)/bin/python -m pytest -n 3 --dist loadfile -p no:cacheprovider tests/integration -k "$(FORKED_LAUNCHES)"
	$(CUDA_VENV)/bin/python examples/train_digits.py

check: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check mplaunch tests benchmarks examples
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	site=$$(mktemp -d) && $(VENV)/bin/mkdocs build --strict --site-dir $$site && $(PY) scripts/check_site.py $$site; \
		status=$$?; rm -rf $$site; exit $$status

docs: $(VENV)/.installed
	$(VENV)/bin/mkdocs serve

# the GPU check (tests/gpu, a few minutes): on a machine with a GPU, with the python3 there as it is (PyTorch's
# CUDA build, pytest, pytest-timeout, psutil, numpy, cloudpickle, threadpoolctl): no virtual environment, no
# network. Without a GPU it stops at once, non-zero: a check that skipped everything would prove nothing.
gpu-check:
	@$(PYTHON) -c "import sys, torch; n = torch.cuda.device_count(); print(f'gpu-check: torch {torch.__version__}, {n} CUDA device(s)'); sys.exit(0 if n else 'gpu-check: no CUDA device here (or a CPU build of torch): run it on a machine with a GPU')"
	PYTHONPATH=. $(PYTHON) -m pytest tests/gpu -p no:cacheprovider -v -rA -s

bench: $(VENV)/.installed
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[test,bench]"
	$(PY) benchmarks/run.py --quick

clean:
	rm -rf $(VENV) $(CUDA_VENV) .pytest_cache *.egg-info site
