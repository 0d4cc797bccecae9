# One-command set-up and checks for a fresh machine. `make demo` and `make test` create the virtual environment.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
# torch is installed first, on its own: a bare `torch` requirement in a fresh environment resolves, on an ordinary
# Linux machine, to the CUDA build from PyPI (several GB). PyTorch's CPU index is added as an extra index when it can
# be reached: its `2.13.0+cpu` sorts above PyPI's `2.13.0`, so pip takes the CPU build. When it cannot be reached,
# pip's own configuration decides (some machines are set up to find a CPU build first). `make setup TORCH_CPU_INDEX=`
# skips the CPU index; `TORCH_SPEC` names another build.
TORCH_SPEC ?= torch==2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: setup demo test test-upstream test-standalone test-gpu lint docs clean distclean

setup: $(VENV)/.installed

$(VENV)/.installed: setup.py pyproject.toml
	@mkdir -p $(VENV) && date +%s > $(VENV)/.setup-started
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@if [ -n "$(TORCH_CPU_INDEX)" ] && $(PY) -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/torch/', timeout=15)" "$(TORCH_CPU_INDEX)" 2>/dev/null; then \
		echo "make setup: $(TORCH_SPEC), preferring the CPU build from $(TORCH_CPU_INDEX)"; \
		$(PY) -m pip install --quiet $(TORCH_SPEC) --extra-index-url $(TORCH_CPU_INDEX); \
	else \
		echo "make setup: $(TORCH_SPEC) from pip's configured indexes ($(if $(TORCH_CPU_INDEX),$(TORCH_CPU_INDEX) not reachable,TORCH_CPU_INDEX is empty))"; \
		$(PY) -m pip install --quiet $(TORCH_SPEC); \
	fi
	$(PY) -W ignore -c "import torch; print('make setup: torch', torch.__version__, '(CUDA build)' if torch.version.cuda else '(CPU build)')"
	$(PY) -m pip install --quiet -e ".[test,docs]"
	@echo "make setup: done in $$(( $$(date +%s) - $$(cat $(VENV)/.setup-started) )) s"
	touch $@

demo: setup
	$(PY) examples/demo.py

# Three test processes (pytest-xdist): most tests spend much of their time waiting on the ranks they start. On 2 cores
# the suite took 27 min in one process and 15 min in two (2026-12-03); of one fresh clone on 2026-12-04, 817 s in two
# and 719 s in three, all passed both times. PYTEST_WORKERS=0 runs it in one process.
PYTEST_WORKERS ?= 3

# The suite (without the core's own tests, which the sdist check runs against the same release), then the checks
# against Lightning's own code: tools/test_all.sh says why.
test: setup
	bash tools/test_all.sh $(PY) $(PYTEST_WORKERS)

# The series (tools/upstream_series.py) written into Lightning's pinned master, and Lightning's tests run on it; then
# written into the installed release's sdist, and the core's tests run on it with Lightning's names.
test-upstream: setup
	bash tools/test_upstream_checks.sh $(PY)

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

# Build outputs and what the demo wrote; the virtual environment stays (`make distclean` removes it too).
clean:
	rm -rf docs/build build *.egg-info src/*.egg-info demo_output

distclean: clean
	rm -rf $(VENV)
