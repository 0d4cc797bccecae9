"""Compare a checkpoint's names, shapes and dtypes with a model's before anything is written into the model.

Upstream destination: ``src/lightning/fabric/utilities/load.py``.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from lightning_fsdp.loading.errors import CheckpointLoadError
from lightning_fsdp.loading.sources import TensorSpec

#: Prefixes that wrappers add to every name: DDP and DataParallel, ``torch.compile``, Fabric and Lightning modules.
_WRAPPER_PREFIXES = ("module.", "_orig_mod.", "model.", "_forward_module.", "_fsdp_wrapped_module.")
_SHOWN = 5


@dataclass(frozen=True)
class TargetSpec:
    """A tensor the model expects: its names (the first is the one it is stored under; the rest are tied aliases)."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class LoadPlan:
    """Which checkpoint tensor feeds which model tensor, and what was left out."""

    sources: dict[str, str] = field(default_factory=dict)
    """Primary target name -> name of the checkpoint tensor to read it from."""
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    casts: dict[str, tuple[torch.dtype, torch.dtype]] = field(default_factory=dict)

    def skipped_summary(self) -> str:
        parts = []
        if self.missing:
            parts.append(f"{len(self.missing)} missing key(s) left as they were ({_names(self.missing)})")
        if self.unexpected:
            parts.append(f"{len(self.unexpected)} unexpected key(s) ignored ({_names(self.unexpected)})")
        return "; ".join(parts)


def plan_load(targets: Sequence[TargetSpec], specs: Mapping[str, TensorSpec], strict: bool) -> LoadPlan:
    """Match the checkpoint's tensors to the model's, or raise one error that lists every problem.

    Tied weights count as present when any of their names is in the checkpoint. Floating-point tensors of another
    dtype are cast (a bf16 file into an fp32 model); other dtype changes and shape mismatches are errors even with
    ``strict=False``, as in :meth:`torch.nn.Module.load_state_dict`.

    """
    plan = LoadPlan()
    expected_names: set[str] = set()
    shape_mismatches: list[str] = []
    dtype_mismatches: list[str] = []
    for target in targets:
        expected_names.update(target.names)
        present = [name for name in target.names if name in specs]
        if not present:
            plan.missing.append(target.names[0])
            continue
        source_name = present[0]
        spec = specs[source_name]
        if spec.shape != target.shape:
            shape_mismatches.append(f"{source_name!r}: checkpoint {_shape(spec.shape)}, model {_shape(target.shape)}")
            continue
        if spec.dtype != target.dtype:
            if not (spec.dtype.is_floating_point and target.dtype.is_floating_point):
                dtype_mismatches.append(f"{source_name!r}: checkpoint {spec.dtype}, model {target.dtype}")
                continue
            plan.casts[target.names[0]] = (spec.dtype, target.dtype)
        plan.sources[target.names[0]] = source_name
    plan.unexpected = [name for name in specs if name not in expected_names]

    problems = []
    if strict and plan.missing:
        problems.append(
            f"{len(plan.missing)} missing key(s), in the model but not the checkpoint: {_names(plan.missing)}"
        )
    if strict and plan.unexpected:
        problems.append(
            f"{len(plan.unexpected)} unexpected key(s), in the checkpoint but not the model: {_names(plan.unexpected)}"
        )
    if shape_mismatches:
        problems.append(f"{len(shape_mismatches)} shape mismatch(es): {_first(shape_mismatches)}")
    if dtype_mismatches:
        problems.append(f"{len(dtype_mismatches)} dtype mismatch(es) that cannot be cast: {_first(dtype_mismatches)}")
    if not problems and not plan.sources and targets:
        problems.append(f"no checkpoint tensor matches a model tensor (checkpoint keys: {_names(list(specs))})")
    if problems:
        hint = _prefix_hint(expected_names, set(specs))
        fixes = [hint] if hint else []
        if strict and not shape_mismatches and not dtype_mismatches:
            fixes.append("To load only the tensors that match, pass `strict=False`.")
        raise CheckpointLoadError(
            "The checkpoint does not match the model; nothing was loaded and the model is unchanged.\n- "
            + "\n- ".join(problems)
            + ("\n" + " ".join(fixes) if fixes else "")
        )
    return plan


def _prefix_hint(expected: set[str], found: set[str]) -> str:
    for prefix in _WRAPPER_PREFIXES:
        stripped = {name.removeprefix(prefix) for name in found if name.startswith(prefix)}
        if stripped and len(stripped & expected) > len(found & expected):
            return (
                f"The checkpoint's names start with {prefix!r}, which a wrapper added when it was saved: they match"
                f" the model once it is removed. Re-save it without the prefix, e.g. `torch.save({{k.removeprefix("
                f"{prefix!r}): v for k, v in torch.load(path, mmap=True).items()}}, new_path)`."
            )
        added = {name.removeprefix(prefix) for name in expected if name.startswith(prefix)}
        if added and len(added & found) > len(found & expected):
            return (
                f"The model's names start with {prefix!r} (the model is wrapped, e.g. by `torch.compile` or"
                " DDP) but the checkpoint's do not: load the checkpoint into the unwrapped module instead."
            )
    return ""


def _names(names: Sequence[str]) -> str:
    return _first([repr(name) for name in names])


def _first(items: Sequence[str]) -> str:
    shown = ", ".join(items[:_SHOWN])
    return shown + (f", ... ({len(items) - _SHOWN} more)" if len(items) > _SHOWN else "")


def _shape(shape: tuple[int, ...]) -> str:
    return f"({', '.join(map(str, shape))})" if len(shape) != 1 else f"({shape[0]},)"
