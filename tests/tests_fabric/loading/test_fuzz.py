"""A seeded fuzz test over the structural bytes of every checkpoint format the loader reads.

Each mutated file goes through `fabric.load` (a 1-rank FSDP model), `describe_checkpoint` (inspect) and
`convert_checkpoint` (whose output is loaded too). Each must raise `CheckpointLoadError` or load exactly the original
values: any other exception, other values, a hang or a crash fails. All failures are reported at once, grouped by
format, kind of mutation and entry point, each with the directory of its mutated checkpoint (kept under pytest's
temporary directory: ``describe_checkpoint`` of ``<dir>/ckpt/...`` reproduces it). The jobs run in a child process whose
address space is limited to 3 GiB above its start: a ``MemoryError`` means that a 30 KB file made a reader allocate
gigabytes. ``LIGHTNING_FSDP_FUZZ_SEED`` draws another set of mutations.
"""

import os
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest
import torch

from lightning_fsdp.loading.convert import convert_checkpoint
from tests.tests_fabric.helpers import fuzz
from tests.tests_fabric.helpers.checkpoints import write_checkpoint
from tests.tests_fabric.helpers.models import TinyTransformer
from tests.tests_fabric.helpers.runif import RunIf

SEED = int(os.environ.get("LIGHTNING_FSDP_FUZZ_SEED", "20240611"))
_JOB_TIMEOUT = 10.0
_BUDGET = 300.0

_ZIP = {
    "zip field": 16,
    "zip signature": 3,
    "zip header byte": 6,
    "zip truncate": 8,
    "zip duplicate name": 2,
    "data.pkl opcode": 8,
    "data.pkl length": 6,
    "data.pkl int": 12,
    "data.pkl stop": 4,
}
_INDEX = {
    "escaping path": 3,
    "missing file": 3,
    "other shard": 1,
    "not a string": 2,
    "names": 2,
    "duplicate key": 2,
    "structure": 4,
    "truncate": 3,
    "json byte": 3,
}
_PICKLES = {"pickle opcode": 10, "pickle length": 8, "pickle int": 12, "pickle truncate": 6}
_COUNTS = {
    "torch-zip": _ZIP,
    "torch-legacy": {**_PICKLES, "element count": 10, "data truncate": 6},
    "safetensors": {
        "header length": 8,
        "header byte": 6,
        "truncate": 6,
        "dtype": 6,
        "shape": 10,
        "data offsets": 14,
        "duplicate key": 3,
        "missing entry": 1,
        "metadata": 2,
    },
    "hf-index-safetensors": _INDEX,
    "hf-index-bin": {**_INDEX, "zip field": 6, "zip truncate": 2, "data.pkl int": 4},
    "fabric-full": {k: max(1, v // 2) for k, v in _ZIP.items()},
    "dcp": {**_PICKLES, "pickle int": 16},
}


def _state_dict() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = TinyTransformer()
    with torch.no_grad():
        model.scale.uniform_()  # not the value a fresh model's buffer gets
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def _fabric_checkpoint(state_dict: dict[str, torch.Tensor]) -> dict:
    model = TinyTransformer()
    optimizer = torch.optim.Adam(model.parameters())
    for parameter in model.parameters():
        parameter.grad = torch.ones_like(parameter)
    optimizer.step()
    return {"model": state_dict, "optimizer": optimizer.state_dict(), "step": 5}


def _originals(directory: Path, state_dict: dict[str, torch.Tensor]) -> dict[str, fuzz.Original]:
    originals = {}
    for fmt in ("torch-zip", "torch-legacy", "safetensors", "hf-index-safetensors", "hf-index-bin"):
        path = write_checkpoint(state_dict, directory / fmt, fmt)
        if fmt == "torch-legacy":
            path.write_bytes(fuzz.canonical_legacy_keys(path.read_bytes()))
        originals[fmt] = fuzz.Original(fmt, directory / fmt, path.name)
    (directory / "fabric-full").mkdir()
    torch.save(_fabric_checkpoint(state_dict), directory / "fabric-full" / "fabric.ckpt")
    originals["fabric-full"] = fuzz.Original("fabric-full", directory / "fabric-full", "fabric.ckpt")
    convert_checkpoint(originals["torch-zip"].directory / originals["torch-zip"].entry, directory / "dcp")
    metadata = directory / "dcp" / ".metadata"
    metadata.write_bytes(fuzz.canonical_dcp_metadata(metadata.read_bytes()))
    originals["dcp"] = fuzz.Original("dcp", directory / "dcp", ".")
    return originals


def _mutations(originals: dict[str, fuzz.Original], decoys: Path, state_dict: dict) -> list[fuzz.Mutation]:
    mutations = []
    for fmt, original in originals.items():
        target = ".metadata" if fmt == "dcp" else original.entry
        data = (original.directory / target).read_bytes()
        mutations.append(fuzz.Mutation(fmt, "baseline", target, 0, "not mutated", data))
        seed = f"{SEED}:{fmt}"
        counts = _COUNTS[fmt]
        if fmt in ("torch-zip", "fabric-full"):
            candidates = fuzz.zip_candidates(seed, data)
        elif fmt == "torch-legacy":
            candidates = fuzz.legacy_candidates(seed, data)
        elif fmt == "safetensors":
            candidates = fuzz.safetensors_candidates(seed, data)
        elif fmt == "dcp":
            candidates = fuzz.pickle_candidates(seed, data, [fuzz.map_pickle(data)], int_roles=("int",))
        else:
            bigger = {name: tensor + 1 for name, tensor in state_dict.items()}
            decoy = write_checkpoint(bigger, decoys / fmt, fmt).parent
            shards = sorted(path.name for path in original.directory.iterdir() if path.name != target)
            candidates = fuzz.index_candidates(seed, data, shards, {s: (decoy / s).read_bytes() for s in shards})
            if fmt == "hf-index-bin":
                shard_counts = {kind: count for kind, count in counts.items() if kind not in _INDEX}
                shard_data = (original.directory / shards[0]).read_bytes()
                shard_candidates = fuzz.zip_candidates(f"{seed}:{shards[0]}", shard_data)
                mutations += fuzz.sample(SEED, fmt, shards[0], shard_candidates, shard_counts)
                counts = {kind: count for kind, count in counts.items() if kind in _INDEX}
        mutations += fuzz.sample(SEED, fmt, target, candidates, counts)
    return mutations


@RunIf(linux_only=True)
def test_structural_mutations_load_exactly_or_raise_checkpoint_load_error(tmp_path):
    started = time.monotonic()
    state_dict = _state_dict()
    torch.save(state_dict, tmp_path / "expected.pt")
    originals = _originals(tmp_path / "originals", state_dict)
    mutations = _mutations(originals, tmp_path / "decoys", state_dict)
    jobs = []
    for index, mutation in enumerate(mutations):
        path = fuzz.materialize(mutation, originals[mutation.fmt], tmp_path / "mutations" / f"{index:03d}")
        jobs += [fuzz.Job(index, entry, str(path)) for entry in fuzz.ENTRY_POINTS]
    prepared = time.monotonic()
    verdicts = fuzz.run_jobs(jobs, tmp_path / "expected.pt", tmp_path / "scratch", _JOB_TIMEOUT, _BUDGET)

    outcomes = Counter((job.entry, verdicts[i].outcome if verdicts[i].ok else "failed") for i, job in enumerate(jobs))
    seconds: Counter = Counter()
    for i, job in enumerate(jobs):
        seconds[(mutations[job.mutation].fmt, job.entry)] += verdicts[i].seconds
    print(
        f"\n{len(mutations)} mutations, {len(jobs)} jobs (seed {SEED}): prepared in {prepared - started:.1f} s,"
        f" ran in {time.monotonic() - prepared:.1f} s; outcomes: {dict(sorted(outcomes.items()))}"
        f"\nseconds per format and entry point: { {k: round(v, 1) for k, v in sorted(seconds.items())} }"
    )
    groups: dict[tuple[str, str, str], list[str]] = defaultdict(list)
    totals: Counter = Counter()
    for i, job in enumerate(jobs):
        mutation = mutations[job.mutation]
        key = (mutation.fmt, mutation.kind, job.entry)
        totals[key] += 1
        if not verdicts[i].ok:
            groups[key].append(
                f"    [{mutation.describe(SEED)}] {verdicts[i].outcome}  (file: mutations/{job.mutation:03d})"
            )
    failed = sum(len(messages) for messages in groups.values())
    if failed:
        lines = [
            f"{failed} of {len(jobs)} jobs failed ({len(mutations)} mutations x {len(fuzz.ENTRY_POINTS)} entry points,"
            f" seed {SEED}); the mutated files are under {tmp_path}. A job passes when it raises CheckpointLoadError"
            " or loads exactly the original values.",
            "Failures by (format, kind, entry point):",
        ]
        lines += [f"  {' / '.join(key)}: {len(groups[key])} of {totals[key]}" for key in sorted(groups)]
        lines.append("All failures:")
        for key in sorted(groups):
            lines.append(f"  {' / '.join(key)}:")
            lines += groups[key]
        pytest.fail("\n".join(lines), pytrace=False)


@RunIf(linux_only=True)
def test_harness_reports_crashes_hangs_errors_and_other_values(tmp_path):
    """The harness itself: each way a job can fail is reported with its job, and the jobs after it still run."""
    state_dict = _state_dict()
    torch.save(state_dict, tmp_path / "expected.pt")
    good = str(write_checkpoint(state_dict, tmp_path / "good", "safetensors"))
    other = str(write_checkpoint({k: v + 1 for k, v in state_dict.items()}, tmp_path / "other", "safetensors"))
    entries = [("load", good), ("_crash", good), ("_hang", good), ("_raise", good), ("load", other), ("convert", good)]
    jobs = [fuzz.Job(index, entry, path) for index, (entry, path) in enumerate(entries)]
    verdicts = fuzz.run_jobs(jobs, tmp_path / "expected.pt", tmp_path / "scratch", job_timeout=3.0, budget=120.0)
    outcomes = [verdicts[index].outcome for index in range(len(jobs))]
    assert [verdicts[index].ok for index in range(len(jobs))] == [True, False, False, False, False, True], outcomes
    assert outcomes[0] == outcomes[5] == "loaded"
    assert outcomes[1] == "crashed: the process died with SIGSEGV"
    assert outcomes[2] == "hung: no result within 3 s"
    assert outcomes[3].startswith("raised ValueError: raised on purpose (at fuzz.py:")
    assert outcomes[4].startswith("loaded different values, without an error: scale, embedding.weight,")
