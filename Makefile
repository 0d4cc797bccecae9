# One-command set-up and checks for a fresh machine. `make demo` and `make test` create the virtual environment.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
# The CPU build of torch must be installed before anything that depends on torch: a bare `torch` requirement in a
# fresh environment resolves to a CUDA build of several GB.
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup demo test test-upstream test-standalone test-gpu lint docs clean

setup: $(VENV)/.installed

$(VENV)/.installed: setup.py pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_SPEC)
	$(PY) -m pip install --quiet -e ".[test,docs]"
	touch $@

demo: setup
	$(PY) examples/demo.py

test: setup
	$(PY) -m pytest tests -q
	bash tools/test_patched_upstream.sh $(PY)

# The change written into the sdist of the installed lightning release, and this project's tests run against it.
test-upstream: setup
	bash tools/test_patched_upstream.sh $(PY)

test-standalone: setup
	bash tests/run_standalone_tests.sh

# On a machine with a GPU: the single-GPU tests, the multi-GPU tests it can run and the benchmark on the GPU, with one
# summary, in under 8 minutes from a fresh clone. It runs `make setup` itself, and only where a GPU exists: elsewhere it
# says that there is none and exits 0 (tools/test_gpu.sh).
test-gpu:
	VENV=$(VENV) PYTHON=$(PYTHON) bash tools/test_gpu.sh

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

docs: setup
	$(VENV)/bin/sphinx-build -W --keep-going -E -b html docs/source-fabric docs/build/html

clean:
	rm -rf $(VENV) docs/build build *.egg-info src/*.egg-info demo_output
