#!/usr/bin/env bash
# `make test-gpu`: every CUDA check of this project in one command, on a machine with one GPU or more, from a fresh
# clone, within a time budget (default 540 s, set-up included: such a machine is lent for a few minutes).
#
#   1. finds the GPUs (`nvidia-smi -L`); without one it says so and exits 0, having installed nothing;
#   2. `make setup`, then makes sure torch in the venv is a CUDA build: a CPU build (`torch.version.cuda` is None, e.g.
#      from a pip configured to find CPU wheels first) is replaced with PyPI's torch==2.13.0, the CUDA build on Linux
#      x86_64 (about 3 GB with NVIDIA's libraries: one to three minutes on a data-centre link);
#   3. the single-GPU tests (tests/tests_fabric/test_single_gpu.py; FSDP1 and FSDP2 side by side, on the same GPU);
#   4. the standalone multi-GPU tests the machine can run (each in its own process, tests/run_standalone_tests.sh;
#      with one GPU they are all skipped, collected in one process);
#   5. the benchmark's small full checkpoint on the GPU, this project against upstream (`--device cuda`, one rank);
#   6. one summary: passed / failed / skipped, the benchmark's ratios, the time of each step.
# Exits 1 when a test fails, the benchmark fails or a step did not fit the budget.
#
# Variables: VENV (.venv), PYTHON (python3, to create it), TORCH_SPEC (what `make setup` installs), TORCH_CUDA_INDEX
# (where the CUDA build comes from, default PyPI), TEST_GPU_BUDGET (seconds, default 540), TEST_GPU_PYTHON (an
# interpreter that already has a CUDA build of torch, lightning and the test extra's packages, e.g. a GPU image's or a
# conda environment's: used as it is, with no set-up and nothing installed, for machines that cannot reach an index).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
START=$SECONDS
BUDGET=${TEST_GPU_BUDGET:-540}
VENV=${VENV:-.venv}
PY=$VENV/bin/python
TORCH_VERSION=2.13.0
TORCH_CUDA_INDEX=${TORCH_CUDA_INDEX:-https://pypi.org/simple}
# What the later steps need at least, in seconds: the multi-GPU step and the benchmark.
RESERVE_STANDALONE=40
RESERVE_BENCHMARK=150

# Seconds of the budget left, at least 1 (`timeout 0` would mean no limit at all).
left() {
  local seconds=$((BUDGET - (SECONDS - START)))
  echo $((seconds > 0 ? seconds : 1))
}
step_start() {
  STEP_T0=$SECONDS
  echo
  echo "=== $1 ($(left) s of the budget left)"
}
step_time() { echo $((SECONDS - STEP_T0)); }
# The CUDA version torch under $PY was built for; empty for a CPU build or no torch.
torch_cuda() { "$PY" -c "import torch; print(torch.version.cuda or '')" 2>/dev/null; }

# The driver's view, before anything is installed: torch may not be there yet, or be a CPU build.
gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
  gpus=$(timeout 60 nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
elif [ -d /proc/driver/nvidia/gpus ]; then
  gpus=$(find /proc/driver/nvidia/gpus -mindepth 1 -maxdepth 1 | wc -l)
fi
if [ "$gpus" -eq 0 ]; then
  echo "make test-gpu: no GPU on this machine (the NVIDIA driver lists none), so there is nothing to check: skipped."
  echo "Run it on a machine with an NVIDIA GPU; the CPU checks are \`make test\`."
  exit 0
fi
echo "make test-gpu: $gpus GPU(s): $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 |
  head -n 1)"
echo "budget: ${BUDGET} s in all, set-up included"

WORK=$(mktemp -d "${TMPDIR:-/tmp}/lightning_fsdp_test_gpu.XXXXXX")
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" # this checkout, whichever one the venv's install points at

# --- set-up -------------------------------------------------------------------------------------------------------
step_start "set-up: the virtual environment and a CUDA build of torch"
setup_note=""
if [ -n "${TEST_GPU_PYTHON:-}" ]; then
  PY=$TEST_GPU_PYTHON
  setup_note=" (TEST_GPU_PYTHON: $PY as it is, nothing installed)"
  echo "TEST_GPU_PYTHON=$PY: no set-up; this checkout is on PYTHONPATH."
  cuda_build=$(torch_cuda)
  if [ -z "$cuda_build" ]; then
    echo "make test-gpu: FAILED: torch under TEST_GPU_PYTHON=$PY is a CPU build (or missing): give an interpreter"
    echo "whose torch is a CUDA build, or leave TEST_GPU_PYTHON unset for the set-up in $VENV."
    exit 1
  fi
else
  echo "make setup: from a fresh clone it installs torch==$TORCH_VERSION (on Linux x86_64, PyPI's is the CUDA build:"
  echo "about 3 GB with NVIDIA's libraries, one to three minutes), then this package with its test extra."
  # TORCH_SPEC, when given, reaches `make` from the environment (or from `make test-gpu TORCH_SPEC=...`).
  # Without the CPU index that `make setup` otherwise prefers: the CUDA build is wanted here.
  if ! timeout "$(left)" make -s setup VENV="$VENV" PYTHON="${PYTHON:-python3}" TORCH_CPU_INDEX=; then
    echo "make test-gpu: FAILED: \`make setup\` did not finish (see above)."
    exit 1
  fi
  cuda_build=$(torch_cuda)
  if [ -z "$cuda_build" ]; then
    echo "torch in $VENV is a CPU build (or missing): installing the CUDA build of torch==$TORCH_VERSION from"
    echo "$TORCH_CUDA_INDEX (about 3 GB with NVIDIA's libraries; one to three minutes on a data-centre link)."
    "$PY" -m pip uninstall --yes --quiet torch >/dev/null 2>&1
    # Only that index: a pip configuration that finds CPU wheels first (find-links, an extra index) would pick the
    # CPU build again, since `2.13.0+cpu` satisfies `torch==2.13.0` and sorts above `2.13.0`.
    if ! env -u PIP_FIND_LINKS -u PIP_EXTRA_INDEX_URL -u PIP_INDEX_URL -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null \
      timeout "$(left)" "$PY" -m pip install --quiet --index-url "$TORCH_CUDA_INDEX" "torch==$TORCH_VERSION"; then
      echo "make test-gpu: FAILED: could not install torch==$TORCH_VERSION from $TORCH_CUDA_INDEX (within the budget)."
      echo "Set TORCH_CUDA_INDEX to an index this machine reaches that has the CUDA build."
      exit 1
    fi
    cuda_build=$(torch_cuda)
    setup_note=" (the CUDA build of torch installed)"
    if [ -z "$cuda_build" ]; then
      echo "make test-gpu: FAILED: $TORCH_CUDA_INDEX gave a CPU build of torch==$TORCH_VERSION."
      exit 1
    fi
  fi
fi
torch_info=$("$PY" -c "import torch; print(torch.__version__, torch.cuda.is_available(), torch.cuda.device_count())")
read -r torch_version cuda_available visible <<<"$torch_info"
echo "torch $torch_version (CUDA $cuda_build): available=$cuda_available, $visible device(s) visible"
if [ "$cuda_available" != "True" ]; then
  echo "make test-gpu: FAILED: torch $torch_version cannot use the GPU (CUDA $cuda_build; a driver too old for it?"
  echo "nvidia-smi reports driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -n 1))."
  exit 1
fi
SETUP_SECONDS=$(step_time)

# --- single-GPU tests ---------------------------------------------------------------------------------------------
step_start "single-GPU tests: tests/tests_fabric/test_single_gpu.py, FSDP1 and FSDP2 side by side"
limit=$(($(left) - RESERVE_STANDALONE - RESERVE_BENCHMARK))
single_status="run"
if [ "$limit" -lt 60 ]; then
  single_status="not run: ${limit} s left for it"
else
  pids=()
  for strategy in fsdp1 fsdp2; do
    timeout "$limit" "$PY" -m pytest tests/tests_fabric/test_single_gpu.py -k "$strategy" -q -rs -p no:cacheprovider \
      --junitxml="$WORK/single-$strategy.xml" >"$WORK/single-$strategy.log" 2>&1 &
    pids+=($!)
  done
  for index in "${!pids[@]}"; do
    wait "${pids[$index]}"
    code=$?
    [ "$code" -eq 124 ] && single_status="timed out after $limit s"
  done
  cat "$WORK/single-fsdp1.log" "$WORK/single-fsdp2.log"
fi
SINGLE_SECONDS=$(step_time)

# --- multi-GPU tests ----------------------------------------------------------------------------------------------
step_start "multi-GPU tests (standalone)"
limit=$(($(left) - RESERVE_BENCHMARK))
standalone_status="run"
if [ "$limit" -lt 20 ]; then
  standalone_status="not run: ${limit} s left for it"
elif [ "$visible" -ge 2 ]; then
  # Each test in its own process, as Lightning runs them; the script prints "standalone: P passed, F failed, S skipped".
  PYTHON="$PY" timeout "$limit" bash tests/run_standalone_tests.sh tests 2>&1 | tee "$WORK/standalone.log"
  [ "${PIPESTATUS[0]}" -eq 124 ] && standalone_status="timed out after $limit s"
else
  # With one GPU every one of them is skipped: collecting them in one process says so without a process per test.
  PL_RUN_STANDALONE_TESTS=1 timeout "$limit" "$PY" -m pytest tests -q -rs -p no:cacheprovider \
    --junitxml="$WORK/standalone.xml" 2>&1 | tail -n 5
  [ "${PIPESTATUS[0]}" -eq 124 ] && standalone_status="timed out after $limit s"
fi
STANDALONE_SECONDS=$(step_time)

# --- benchmark ----------------------------------------------------------------------------------------------------
step_start "benchmark: the small size on the GPU, this project against upstream"
limit=$(($(left) - 5))
bench_status="run"
if [ "$limit" -lt 30 ]; then
  bench_status="not run: ${limit} s left for it"
else
  timeout "$limit" "$PY" benchmarks/bench_load --device cuda --size small --ranks 1 --formats full \
    --strategy both --cache file --retry-busy 0 --timeout 120 --workdir "$WORK/bench" --output "$WORK/bench.md" \
    >/dev/null 2>"$WORK/bench.log"
  code=$?
  tail -n 20 "$WORK/bench.log"
  [ "$code" -eq 124 ] && bench_status="timed out after $limit s"
  [ "$code" -ne 0 ] && [ "$code" -ne 124 ] && bench_status="failed (exit code $code)"
fi
BENCH_SECONDS=$(step_time)

# --- summary ------------------------------------------------------------------------------------------------------
echo
"$PY" - "$WORK" "$single_status" "$standalone_status" "$bench_status" "$visible" \
  "$SETUP_SECONDS" "$SINGLE_SECONDS" "$STANDALONE_SECONDS" "$BENCH_SECONDS" "$((SECONDS - START))" "$BUDGET" \
  "$setup_note" <<'EOF'
import json
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import torch

work = Path(sys.argv[1])
single_status, standalone_status, bench_status = sys.argv[2:5]
visible = int(sys.argv[5])
setup_s, single_s, standalone_s, bench_s, total_s, budget = (int(value) for value in sys.argv[6:12])
setup_note = sys.argv[12]
problems = []


def junit(paths):
    """passed, failed, skipped over the JUnit files; None if one is missing (the run did not finish)."""
    passed = failed = skipped = 0
    for path in paths:
        if not path.is_file():
            return None
        for suite in ElementTree.parse(path).getroot().iter("testsuite"):
            tests, errors, failures = (int(suite.get(key, 0)) for key in ("tests", "errors", "failures"))
            skips = int(suite.get("skipped", 0))
            failed += errors + failures
            skipped += skips
            passed += tests - errors - failures - skips
    return passed, failed, skipped


def counts(name, status, result):
    if status != "run":
        problems.append(f"{name}: {status}")
        return status
    if result is None:
        problems.append(f"{name}: no result (the run did not finish)")
        return "no result"
    passed, failed, skipped = result
    if failed:
        problems.append(f"{name}: {failed} failed")
    return f"{passed} passed, {failed} failed, {skipped} skipped"


print(f"=== make test-gpu: summary ({torch.cuda.get_device_name(0)}, {visible} GPU(s), torch {torch.__version__})")
print(f"set-up            {setup_s:4d} s{setup_note}")
single = junit([work / "single-fsdp1.xml", work / "single-fsdp2.xml"])
print(f"single-GPU tests  {single_s:4d} s  {counts('single-GPU tests', single_status, single)}")
if (work / "standalone.log").is_file():  # run_standalone_tests.sh, one process per test
    lines = [line for line in (work / "standalone.log").read_text().splitlines() if line.startswith("standalone: ")]
    standalone = None
    if lines:
        numbers = [int(part.split()[0]) for part in lines[-1].removeprefix("standalone: ").split(", ")]
        standalone = (numbers[0], numbers[1], numbers[2])
else:
    standalone = junit([work / "standalone.xml"])
note = "" if visible >= 2 else " (they need 2 GPUs)"
print(f"multi-GPU tests   {standalone_s:4d} s  {counts('multi-GPU tests', standalone_status, standalone)}{note}")

results_path = work / "bench" / "results.json"
bench_line = bench_status
rows = []
if bench_status == "run":
    if not results_path.is_file():
        problems.append("benchmark: no results")
        bench_line = "no results"
    else:
        results = json.loads(results_path.read_text())["results"]
        by_key = {(r["case"]["strategy"], r["case"]["format"], r["case"]["implementation"]): r for r in results}
        wrong = [r for r in results if "error" in r or not r.get("correct")]
        for r in wrong:
            case = r["case"]
            problems.append(f"benchmark: {case['strategy']} {case['format']} {case['implementation']}: "
                            + (r.get("error") or r.get("correct_detail") or "incorrect"))
        bench_line = f"{len(results) - len(wrong)} of {len(results)} loads correct"
        for (strategy, fmt, impl), ours in by_key.items():
            upstream = by_key.get((strategy, fmt, "upstream"))
            if impl != "ours" or upstream is None or "gpu_peak" not in ours or "gpu_peak" not in upstream:
                continue

            def ratio(key):
                return f"{ours[key] / upstream[key]:.2f}x" if upstream[key] > 0 else "n/a"

            rows.append(
                f"  {'FSDP1' if strategy == 'fsdp' else 'FSDP2'} {fmt:4s}  time {ours['load_seconds']:.2f} s vs"
                f" {upstream['load_seconds']:.2f} s ({ratio('load_seconds')}), GPU peak {ours['gpu_peak'] / 1e6:.1f} MB"
                f" vs {upstream['gpu_peak'] / 1e6:.1f} MB ({ratio('gpu_peak')}), host peak PSS {ratio('peak_pss')}"
            )
else:
    problems.append(f"benchmark: {bench_status}")
print(f"benchmark         {bench_s:4d} s  small size, 1 rank on the GPU: {bench_line}")
for row in rows:
    print(row)
if results_path.is_file():
    print(f"  (the full table: {work / 'bench.md'})")
print(f"total             {total_s:4d} s  (budget {budget} s)")
for problem in problems:
    print(f"FAILED: {problem}")
print("RESULT:", "FAILED" if problems else "PASSED")
sys.exit(1 if problems else 0)
EOF
