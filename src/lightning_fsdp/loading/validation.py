"""Compare a checkpoint's names, shapes and dtypes with a model's before anything is written into the model.

Names may differ by a prefix that a wrapper added (``module.`` of DDP, ``_orig_mod.`` of ``torch.compile``, the
attribute of a ``LightningModule``) or by the model class (a ``LlamaForCausalLM`` checkpoint, ``model.*``, for a bare
``LlamaModel``). A ``rename`` maps the checkpoint's names to the model's; without one, a single prefix that makes
every model tensor match is removed or added automatically, and the errors name the ``rename`` that fits the file.
A name that the checkpoint holds exactly as the model names it always wins: a prefix that would load another tensor
in its place, or move it away, is not applied.

Layer: an extension of the package (docs/source-fabric/upstream.rst), not part of the core.
"""

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch.nn import Module

from lightning_fsdp.layouts.targets import TargetSpec, clean_name
from lightning_fsdp.loading.errors import SHOWN_NAMES, CheckpointLoadError, quoted_names, shown_items
from lightning_fsdp.loading.sources import TensorSpec

Rename = Callable[[str], str | None] | Mapping[str, str | None]
"""Checkpoint name -> model name (``None`` leaves the tensor out), or ``{checkpoint prefix: model prefix or None}``."""

#: Prefixes that wrappers add to every name: DDP and DataParallel, ``torch.compile``, Fabric and Lightning modules.
_WRAPPER_PREFIXES = ("module.", "_orig_mod.", "model.", "_forward_module.", "_fsdp_wrapped_module.")
#: How many of the most common first name components of each side are tried as prefixes.
_DATA_PREFIXES = 16
#: How to pass a rename through Fabric, whose ``load`` and ``load_raw`` take no loader options.
_RENAME_USAGE = (
    "(`rename` is an option of the loader: with Fabric, call `fabric.load` or `fabric.load_raw` inside"
    " `with fabric.strategy.load_options(rename=...):`)"
)


@dataclass(frozen=True)
class DeclinedAlignment:
    """A prefix rename that matches every model tensor but changes what the checkpoint's exact names feed."""

    rename: dict[str, str]
    conflicts: list[tuple[str, str, str]]
    """(model name, the checkpoint tensor of that exact name, the one the rename would load instead)."""

    def describe(self) -> str:
        target, exact, other = self.conflicts[0]
        more = f" (and {len(self.conflicts) - 1} more)" if len(self.conflicts) > 1 else ""
        return (
            f"once {_describe(self.rename)}, {other!r} would be loaded into {target!r}{more}, which the checkpoint"
            f" holds by its exact name {exact!r} (an exact name always wins over the automatic alignment)"
        )

    def advice(self, missing: Sequence[str] = ()) -> str:
        exact_names = [exact for _, exact, _ in self.conflicts]
        leaving_out: dict[str, str | None] = {**self.rename, **dict.fromkeys(exact_names)}
        prefer_renamed = (
            f"`rename={leaving_out!r}` loads the renamed tensors and leaves out the exactly named ones"
            if len(exact_names) <= SHOWN_NAMES
            else f"`rename={self.rename!r}` with `strict=False` loads the renamed tensors"
        )
        return (
            f"The names were not aligned automatically: {self.describe()}. The checkpoint holds two candidates for"
            f" {'that tensor' if len(exact_names) == 1 else 'those tensors'}; say which to load: {prefer_renamed},"
            f" and `strict=False` loads only the tensors whose names match exactly"
            f"{f', leaving {len(missing)} ({quoted_names(missing)}) as they were' if missing else ''}. {_RENAME_USAGE}"
        )


@dataclass
class NamePlan:
    """Which checkpoint tensor feeds which model tensor, and what was left out."""

    sources: dict[str, str] = field(default_factory=dict)
    """Primary target name -> name of the checkpoint tensor to read it from (its name in the file, before renaming)."""
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    """Checkpoint tensors that feed no model tensor, by their names in the file."""
    casts: dict[str, tuple[torch.dtype, torch.dtype]] = field(default_factory=dict)
    aligned: dict[str, str] = field(default_factory=dict)
    """The prefix rename found automatically (``{"model.": ""}`` removes, ``{"": "model."}`` adds); empty if none."""
    declined: DeclinedAlignment | None = None
    """The prefix rename that would match every model tensor but was not applied: it changes exact matches."""
    advice: str = ""
    """With ``strict=False``: what would load the skipped tensors (a ``rename``), as the strict error advises it."""

    def skipped_summary(self) -> str:
        parts = []
        if self.missing:
            parts.append(
                f"{len(self.missing)} missing key(s) left as they were ({quoted_names(self.missing)}): they keep the"
                " values they had before the load, from the model's initialisation (none, with"
                " `init_module(empty_init=True)` and no initialisation that writes them: a warning names those)"
            )
        if self.unexpected:
            parts.append(f"{len(self.unexpected)} unexpected key(s) ignored ({quoted_names(self.unexpected)})")
        if parts and self.declined is not None:
            parts.append(f"names matched exactly, because {self.declined.describe()}")
        summary = "; ".join(parts)
        return f"{summary}. {self.advice}" if summary and self.advice else summary


def check_rename(rename: Any) -> None:
    """Raise a :class:`TypeError` unless ``rename`` is ``None``, a callable, or a mapping of prefixes.

    A mapping maps a prefix of the checkpoint's names to the prefix that replaces it in the model's names, or to
    ``None`` to leave those tensors out; the longest matching prefix wins, and ``""`` matches every name (so
    ``{"": "model."}`` adds a prefix). Names that no prefix matches are kept. A callable takes a checkpoint name and
    returns the model's name for it, or ``None`` to leave it out. ``{}`` keeps every name and turns the automatic
    alignment off.

    """
    if rename is None or callable(rename):
        return
    if isinstance(rename, Mapping):
        bad = [
            f"{k!r}: {v!r}" for k, v in rename.items() if not isinstance(k, str) or not isinstance(v, (str, type(None)))
        ]
        if not bad:
            return
        raise TypeError(
            f"`rename` maps prefixes of the checkpoint's names to prefixes of the model's (strings, or `None` to leave"
            f" the tensors out), but it holds {', '.join(bad[:SHOWN_NAMES])}. For example, `rename={{'model.': ''}}`."
        )
    raise TypeError(
        f"`rename` must be a callable (checkpoint name -> model name or `None`) or a mapping of prefixes such as"
        f" `{{'model.': ''}}`, got {type(rename).__name__}."
    )


def plan_load(
    targets: Sequence[TargetSpec],
    specs: Mapping[str, TensorSpec],
    strict: bool,
    rename: Rename | None = None,
    ties: Mapping[str, Iterable[str]] | None = None,
) -> NamePlan:
    """Match the checkpoint's tensors to the model's, or raise one error that lists every problem.

    The checkpoint's names are renamed first (see :func:`check_rename`); the plan still reads each tensor by its
    name in the file. Without a ``rename``, when the names differ and exactly one prefix, removed from or added to
    every checkpoint name, makes every model tensor match without changing what a checkpoint tensor named exactly as
    a model tensor feeds (an exact name always wins), it is applied and said in one info line; otherwise names match
    exactly, with ``strict`` as without, and the error or the summary of what was skipped says why. Tied weights
    count as present when any of their names is in the checkpoint. Floating-point tensors of another dtype are cast
    (a bf16 file into an fp32 model); other dtype changes and shape mismatches are errors even with ``strict=False``,
    as in :meth:`torch.nn.Module.load_state_dict`. ``ties`` (model name -> the names the model ties it to) turns the
    advice for a missing tied copy of a tensor that the checkpoint holds into re-tying them, not ``strict=False``.

    """
    check_rename(rename)
    plan, shape_mismatches, dtype_mismatches = _match(targets, specs, _renamed(specs, rename or {}))
    ambiguous: list[dict[str, str]] = []
    if rename is None and plan.missing:
        aligned, ambiguous, declined = _alignment(targets, list(specs))
        if aligned:
            plan, shape_mismatches, dtype_mismatches = _match(targets, specs, _renamed(specs, aligned))
            plan.aligned = aligned
        elif not ambiguous:
            plan.declined = declined

    problems = []
    if strict and plan.missing:
        problems.append(
            f"{len(plan.missing)} missing key(s), in the model but not the checkpoint: {quoted_names(plan.missing)}"
        )
    if strict and plan.unexpected:
        problems.append(
            f"{len(plan.unexpected)} unexpected key(s), in the checkpoint but not the model:"
            f" {quoted_names(plan.unexpected)}"
        )
    if shape_mismatches:
        problems.append(f"{len(shape_mismatches)} shape mismatch(es): {shown_items(shape_mismatches)}")
    if dtype_mismatches:
        problems.append(
            f"{len(dtype_mismatches)} dtype mismatch(es) that cannot be cast: {shown_items(dtype_mismatches)}"
        )
    if not problems and not plan.sources and targets:
        problems.append(f"no checkpoint tensor matches a model tensor (checkpoint keys: {quoted_names(list(specs))})")
    if not problems and (plan.missing or plan.unexpected) and not plan.aligned and plan.declined is None:
        # `strict=False` skipped tensors whose names nothing aligned: the warning gives the strict error's advice
        plan.advice = " ".join(_rename_fixes(targets, specs, rename, plan, ambiguous, {})[0])
    if problems:
        untied = _untied_copies(targets, plan, ties or {}) if strict else {}
        fixes, inner, paired = _rename_fixes(targets, specs, rename, plan, ambiguous, untied)
        if untied:
            fixes.append(_retie_advice(untied))
        elif (
            strict
            and plan.sources
            and not shape_mismatches
            and not dtype_mismatches
            and plan.declined is None
            and inner is None
            and paired is None
        ):
            fixes.append(f"To load only the tensors that match, {_leaving(plan.missing)}pass `strict=False`.")
        raise CheckpointLoadError(
            "The checkpoint does not match the model; nothing was loaded and the model is unchanged.\n- "
            + "\n- ".join(problems)
            + ("\n" + " ".join(fixes) if fixes else "")
        )
    if plan.aligned:
        rank_zero_info(
            f"The checkpoint's names match the model's once {_describe(plan.aligned)}; loading them so"
            f" (as with `rename={plan.aligned!r}`; pass `rename={{}}` to turn this off)."
        )
    return plan


def _rename_fixes(
    targets: Sequence[TargetSpec],
    specs: Mapping[str, TensorSpec],
    rename: Rename | None,
    plan: NamePlan,
    ambiguous: list[dict[str, str]],
    untied: Mapping[str, str],
) -> tuple[list[str], Any, Any]:
    """The advice that would make the checkpoint's names load (a ``rename``), and the inner or paired rename found."""
    inner = paired = None
    if rename is None and not plan.aligned and plan.declined is None and not ambiguous:
        inner = _inner_rename(targets, specs, len(targets) - len(plan.missing))
    if inner is None and not untied and not plan.aligned and plan.declined is None and not ambiguous:
        paired = _paired_rename(targets, specs, rename)
    if inner:
        return [inner.advice(len(targets))], inner, paired
    if paired:
        return [paired.advice()], inner, paired
    return _advice(targets, list(specs), rename, plan, ambiguous), inner, paired


def _match(
    targets: Sequence[TargetSpec], specs: Mapping[str, TensorSpec], originals: Mapping[str, str]
) -> tuple[NamePlan, list[str], list[str]]:
    """The plan for the checkpoint's tensors under new names (``originals``: new name -> name in the file)."""
    plan = NamePlan()
    expected_names: set[str] = set()
    shape_mismatches: list[str] = []
    dtype_mismatches: list[str] = []
    for target in targets:
        expected_names.update(target.names)
        source_name = _feeding(target, originals)
        if source_name is None:
            plan.missing.append(target.names[0])
            continue
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
    plan.unexpected = [original for name, original in originals.items() if name not in expected_names]
    return plan, shape_mismatches, dtype_mismatches


def _untied_copies(targets: Sequence[TargetSpec], plan: NamePlan, ties: Mapping[str, Iterable[str]]) -> dict[str, str]:
    """Missing name -> the name of a tensor it is tied to that the checkpoint feeds, with the same shape and dtype."""
    shapes = {name: (target.shape, target.dtype) for target in targets for name in target.names}
    untied = {}
    for missing in plan.missing:
        partner = next(
            (name for name in ties.get(missing, ()) if name in plan.sources and shapes.get(name) == shapes[missing]),
            None,
        )
        if partner is not None:
            untied[missing] = partner
    return untied


def _retie_advice(untied: Mapping[str, str]) -> str:
    pairs = shown_items([f"{missing!r} to {partner!r}" for missing, partner in untied.items()])
    return (
        f"The model ties {pairs}, which the checkpoint holds, but the tied names are separate tensors now, so loading"
        " one leaves the other as it is: `strict=False` would leave the missing one uninitialised. Keep them tied: let"
        " `fabric.setup_module` materialise a model created with `fabric.init_module(empty_init=True)` (it keeps ties;"
        " a `param_init_fn` that calls `to_empty` breaks them), or re-tie them before `fabric.setup_module` (after any"
        " `to_empty`), with `model.tie_weights()` for a Hugging Face model."
    )


def check_whole_module(module: Module) -> None:
    """Refuse a submodule of an FSDP model whose parameters are held by an FSDP unit around it.

    ``fabric.load_raw(path, model.model)`` hands the loader a module that FSDP did not wrap on its own: the
    parameters outside its own FSDP units (an embedding, a final norm) live in the flat parameter of a unit that wraps
    its parent, which this module cannot reach, so they would be reported as unexpected.

    Raises:
        CheckpointLoadError: If such parameters exist, saying how to load into the top-level model instead.

    """
    outer = _outer_unit_tensors(module)
    if not outer:
        return
    names = [name for name, _ in outer]
    prefixes = {prefix for _, prefix in outer}
    if len(prefixes) == 1 and None not in prefixes:
        prefix = prefixes.pop()
        how = f"with `rename={{'': {prefix!r}}}` (the module's place in the model) and `strict=False`"
    else:
        how = "with `rename={'': '<the name of this module in the model>.'}` and `strict=False`"
    raise CheckpointLoadError(
        f"The module to load into is a part of an FSDP model, not the model itself: {len(names)} of its tensors"
        f" ({quoted_names(names)}) are held by an FSDP unit that wraps its parent, so they cannot be loaded through it."
        f" Load into the model that `fabric.setup` returned instead, {how}, so that the checkpoint's names land in this"
        f" module and the rest of the model stays as it is. {_RENAME_USAGE}"
    )


def _outer_unit_tensors(module: Module) -> list[tuple[str, str | None]]:
    """The tensors of ``module`` that an FSDP unit outside it holds: (name, the module's prefix there if known)."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp._flat_param import FlatParameter
    except ImportError:  # pragma: no cover (a torch release without FSDP1)
        return []
    from lightning_fsdp.core.fsdp import _join as join

    inner_flat: set[int] = set()
    inner_params: set[int] = set()
    for submodule in module.modules():
        handle = getattr(submodule, "_handle", None) if isinstance(submodule, FullyShardedDataParallel) else None
        if handle is not None:
            inner_flat.add(id(handle.flat_param))
            inner_params.update(id(param) for param in getattr(handle.flat_param, "_params", None) or [])
    found: list[tuple[str, str | None]] = []
    for module_name, submodule in module.named_modules():
        if isinstance(submodule, FullyShardedDataParallel):
            continue
        for name, param in submodule._parameters.items():
            # With `use_orig_params=True`, an outer unit's parameters stay registered here, marked as flattened.
            if param is None or isinstance(param, FlatParameter) or id(param) in inner_params:
                continue
            if getattr(param, "_fsdp_flattened", False):
                found.append((clean_name(join(module_name, name)), None))
        for name, value in vars(submodule).items():
            # With `use_orig_params=False`, they are plain tensor attributes that view the outer flat parameter.
            base = getattr(value, "_base", None) if isinstance(value, torch.Tensor) else None
            if isinstance(base, FlatParameter) and id(base) not in inner_flat:
                relative = clean_name(join(module_name, name))
                found.append((relative, _prefix_in(base, relative)))
    return found


def _prefix_in(flat_param: Any, relative: str) -> str | None:
    """The prefix that the outer unit's name of ``relative`` has, if exactly one of its names ends with it."""
    fqns = [str(fqn) for fqn in getattr(flat_param, "_fqns", ())]
    prefixes = {fqn[: -len(relative)] for fqn in fqns if fqn == relative or fqn.endswith(f".{relative}")}
    return prefixes.pop() if len(prefixes) == 1 else None


def _alignment(
    targets: Sequence[TargetSpec], names: list[str]
) -> tuple[dict[str, str], list[dict[str, str]], DeclinedAlignment | None]:
    """The one prefix rename that makes every model tensor match, and the candidates when several do.

    A rename that changes which checkpoint tensor feeds a model tensor that the checkpoint holds by its exact name is
    not a candidate: the first such one is returned as declined, for the messages.

    """
    if not targets or not names:
        return {}, [], None
    exact = _fed_by(targets, {name: name for name in names})
    working = []
    declined = None
    for candidate in _candidates(targets, names):
        renamed = _with_prefix(names, candidate)
        if renamed is None or not _all_matched(targets, renamed):
            continue
        fed = _fed_by(targets, {_rename_one(name, candidate): name for name in names})
        conflicts = [(target, name, fed[target]) for target, name in exact.items() if fed[target] != name]
        if not conflicts:
            working.append(candidate)
        elif declined is None:
            declined = DeclinedAlignment(candidate, conflicts)
    return (working[0], [], None) if len(working) == 1 else ({}, working, declined)


def _fed_by(targets: Sequence[TargetSpec], originals: Mapping[str, str]) -> dict[str, str]:
    """Primary target name -> the checkpoint tensor (its name in the file) that feeds it."""
    return {target.names[0]: name for target in targets if (name := _feeding(target, originals)) is not None}


def _feeding(target: TargetSpec, originals: Mapping[str, str]) -> str | None:
    """The checkpoint tensor (its name in the file) that feeds ``target``: the first of its names it has, renamed."""
    present = next((name for name in target.names if name in originals), None)
    return None if present is None else originals[present]


def _candidates(targets: Sequence[TargetSpec], names: list[str]) -> list[dict[str, str]]:
    removed = [p for p in dict.fromkeys([*_WRAPPER_PREFIXES, *_common_prefixes(names)]) if _any_starts(names, p)]
    added = dict.fromkeys([*_WRAPPER_PREFIXES, *_common_prefixes(target.names[0] for target in targets)])
    return [{prefix: ""} for prefix in removed] + [{"": prefix} for prefix in added]


def _with_prefix(names: list[str], candidate: dict[str, str]) -> set[str] | None:
    """The names with one prefix removed (``{prefix: ""}``) or added (``{"": prefix}``); ``None`` if two collide."""
    ((removed, added),) = candidate.items()
    if removed:
        renamed = {name[len(removed) :] if name.startswith(removed) else name for name in names}
    else:
        renamed = {added + name for name in names}
    return renamed if len(renamed) == len(names) else None


def _common_prefixes(names: Iterable[str], depth: int = 1) -> list[str]:
    """The most common prefixes of ``depth`` name components (and a dot)."""
    counts = Counter(".".join(parts[:depth]) + "." for name in names if len(parts := name.split(".")) > depth)
    return [prefix for prefix, _ in counts.most_common(_DATA_PREFIXES)]


def _any_starts(names: list[str], prefix: str) -> bool:
    return any(name.startswith(prefix) for name in names)


def _matched(targets: Sequence[TargetSpec], names: set[str]) -> int:
    return sum(1 for target in targets if any(name in names for name in target.names))


def _all_matched(targets: Sequence[TargetSpec], names: set[str]) -> bool:
    return all(any(name in names for name in target.names) for target in targets)


def _rename_one(name: str, rename: Rename) -> str | None:
    if isinstance(rename, Mapping):
        prefix = max((p for p in rename if name.startswith(p)), key=len, default=None)
        if prefix is None:
            return name
        replacement = rename[prefix]
        return None if replacement is None else replacement + name[len(prefix) :]
    new = rename(name)
    if new is not None and not isinstance(new, str):
        raise CheckpointLoadError(
            f"`rename` returned {new!r} ({type(new).__name__}) for the checkpoint tensor {name!r}: it must return the"
            " model's name for it (a string) or `None` to leave it out."
        )
    return new


def _renamed(specs: Mapping[str, TensorSpec], rename: Rename) -> dict[str, str]:
    """New name -> the name in the file, for every tensor that ``rename`` keeps."""
    if isinstance(rename, Mapping) and not rename:
        return {name: name for name in specs}
    originals: dict[str, str] = {}
    for name in specs:
        new = _rename_one(name, rename)
        if new is None:
            continue
        if new in originals:
            raise CheckpointLoadError(
                f"`rename` gives two checkpoint tensors the same name {new!r}: {originals[new]!r} and {name!r}. Map"
                " each checkpoint name to its own model name, or leave one of them out (map it to `None`)."
            )
        originals[new] = name
    return originals


def _advice(
    targets: Sequence[TargetSpec],
    names: list[str],
    rename: Rename | None,
    plan: NamePlan,
    ambiguous: list[dict[str, str]],
) -> list[str]:
    """What would make this checkpoint load, as a ``rename`` value to pass."""
    if rename is not None:
        renamed = [new for new in (_rename_one(name, rename) for name in names[:SHOWN_NAMES]) if new is not None]
        return [f"After `rename`, the checkpoint's names read {quoted_names(renamed)}, ..."] if renamed else []
    if plan.aligned:
        value = _leaving_out(plan)
        if value is None:
            return [f"The names were aligned by `rename={plan.aligned!r}`, found automatically."]
        return [
            f"The names were aligned by `rename={plan.aligned!r}`, found automatically; to leave out the checkpoint"
            f" tensors that the model does not have, pass `rename={value!r}`. {_RENAME_USAGE}"
        ]
    if plan.declined is not None:
        return [plan.declined.advice(plan.missing)]
    if ambiguous:
        choices = " or ".join(f"`rename={candidate!r}`" for candidate in ambiguous[:SHOWN_NAMES])
        return [
            f"The names match the model's with one of several prefixes changed: pass the right one, {choices}."
            f" {_RENAME_USAGE}"
        ]
    best, matched = _best_candidate(targets, names)
    if best is None or matched <= len(targets) - len(plan.missing):
        return []
    partial, left = "", ""
    if matched < len(targets):
        renamed = _with_prefix(names, best) or set()
        unloaded = [target.names[0] for target in targets if not any(name in renamed for name in target.names)]
        partial = " and `strict=False`"
        left = f", and the other {len(unloaded)} ({quoted_names(unloaded)}) stay as they were"
    return [
        f"The checkpoint's names match the model's better once {_describe(best)}: with `rename={best!r}`{partial},"
        f" {matched} of the model's {len(targets)} tensors load{left}. {_RENAME_USAGE}"
    ]


def _leaving(missing: Sequence[str]) -> str:
    """The clause that names the model tensors that ``strict=False`` would leave as they were (empty if none)."""
    return (
        f"leaving the model's {len(missing)} missing tensor(s) ({quoted_names(missing)}) as they were, "
        if missing
        else ""
    )


@dataclass(frozen=True)
class PairedRename:
    """Model tensors that the checkpoint holds under other names, found by pairing shapes and dtypes one to one."""

    base: dict[str, str | None]
    """The prefix rename in effect before the pairs (the caller's mapping, or the best prefix change; ``{}``)."""
    pairs: dict[str, str]
    """Checkpoint name (in the file) -> the model name it pairs with."""
    left_out: list[str]
    """Checkpoint tensors (names in the file) that pair with no model tensor, left out by the rename."""

    @property
    def value(self) -> dict[str, str | None]:
        return {**self.base, **self.pairs, **dict.fromkeys(self.left_out)}

    def advice(self) -> str:
        after = f"Once {_describe(self.base)}, the names" if self.base else "The names"
        pairs = ", ".join(f"{old!r} in the checkpoint is {new!r} in the model" for old, new in self.pairs.items())
        ignored = f" (leaving out {quoted_names(self.left_out)}, which feed no model tensor)" if self.left_out else ""
        return (
            f"{after} that differ pair up one to one by shape and dtype: {pairs}. To load every model tensor{ignored},"
            f" load with this rename: `with fabric.strategy.load_options(rename={self.value!r}):` around"
            f" `fabric.load` or `fabric.load_raw`. `strict=False` is not the fix: it would not load"
            f" {quoted_names(self.pairs.values())}, leaving the model's initial values there."
        )


def _paired_rename(
    targets: Sequence[TargetSpec], specs: Mapping[str, TensorSpec], rename: Rename | None
) -> PairedRename | None:
    """The rename that loads every model tensor by pairing the missing ones with unused checkpoint tensors, if any.

    After the caller's ``rename`` (a mapping) or, without one, the prefix change that matches the most names, each
    missing model tensor must have exactly one unused checkpoint tensor of its shape and of a dtype that loads into it
    (floating-point dtypes cast), and that tensor no other missing one: a shape shared by two candidates is never
    guessed. Unused checkpoint tensors of other shapes are left out. The rename is checked by planning with it.

    """
    if rename is None:
        best, matched = _best_candidate(targets, list(specs))
        base: dict[str, str | None] = dict(best) if best and matched > _matched(targets, set(specs)) else {}
    elif isinstance(rename, Mapping):
        base = dict(rename)
    else:
        return None
    plan, shape_mismatches, dtype_mismatches = _match(targets, specs, _renamed(specs, base))
    if shape_mismatches or dtype_mismatches or not plan.sources or not plan.missing:
        return None
    if len(plan.missing) > SHOWN_NAMES or len(plan.unexpected) > 2 * SHOWN_NAMES:
        return None
    kinds = {target.names[0]: _kind(target.shape, target.dtype) for target in targets}
    unused: dict[tuple, list[str]] = {}
    for name in plan.unexpected:
        unused.setdefault(_kind(specs[name].shape, specs[name].dtype), []).append(name)
    wanted = Counter(kinds[name] for name in plan.missing)
    pairs = {}
    for name in plan.missing:
        candidates = unused.get(kinds[name], [])
        if len(candidates) != 1 or wanted[kinds[name]] != 1:
            return None
        pairs[candidates[0]] = name
    left_out = [name for name in plan.unexpected if name not in pairs]
    paired = PairedRename(base, pairs, left_out)
    check, shape_mismatches, dtype_mismatches = _match(targets, specs, _renamed(specs, paired.value))
    if check.missing or check.unexpected or shape_mismatches or dtype_mismatches:
        return None  # a paired name is also a prefix of another checkpoint name: the mapping would rename that too
    if any(check.sources.get(new) != old for old, new in pairs.items()):
        return None
    return paired


def _kind(shape: tuple[int, ...], dtype: torch.dtype) -> tuple:
    """What a tensor must share with another to feed it: the shape, and the dtype unless both are floating point."""
    return (shape, "floating point" if dtype.is_floating_point else dtype)


@dataclass(frozen=True)
class InnerRename:
    """A rename that changes the checkpoint's names inside, not only by a prefix, and what it loads."""

    prefix: dict[str, str] | None
    """The prefix change applied first (``{"model.": ""}`` removes, ``{"": "model."}`` adds), if any."""
    replacements: tuple[tuple[str, str], ...]
    """``(old, new)`` parts of the names, replaced in turn (``(".q_proj.", ".q_proj.base_layer.")``)."""
    matched: int
    """How many of the model's tensors the checkpoint feeds with this rename."""
    left: list[str]
    """The model's tensors that the checkpoint does not hold even then."""
    extra: list[str] = field(default_factory=list)
    """The checkpoint's tensors (names in the file) that the model does not hold even then."""

    def __call__(self, name: str) -> str:
        renamed = _rename_one(name, self.prefix) if self.prefix else name
        assert renamed is not None
        for old, new in self.replacements:
            renamed = renamed.replace(old, new)
        return renamed

    def expression(self) -> str:
        """The rename as a lambda that the user can paste (the same steps as calling this object)."""
        value = "name"
        if self.prefix:
            ((removed, added),) = self.prefix.items()
            value = f"name.removeprefix({removed!r})" if removed else f"({added!r} + name)"
        return "lambda name: " + value + "".join(f".replace({old!r}, {new!r})" for old, new in self.replacements)

    def advice(self, total: int) -> str:
        changes = [f"{old!r} reads {new!r}" for old, new in self.replacements]
        if self.prefix:
            ((removed, added),) = self.prefix.items()
            changes.insert(0, f"the prefix {removed!r} is removed" if removed else f"the prefix {added!r} is added")
        partial = ""
        if self.left:
            partial = (
                f" The other {len(self.left)} ({quoted_names(self.left)}) are not in this file: add `strict=False` to"
                " leave them as they are (an adapter's tensors when the file holds the base model, or the base model's"
                " when it holds an adapter)."
            )
        if self.extra:
            partial += (
                f" The file's {len(self.extra)} other tensor(s) ({quoted_names(self.extra)}) are not in the model:"
                f" {'`strict=False` also ignores them' if self.left else 'add `strict=False` to ignore them'}."
            )
        return (
            f"The checkpoint's names differ from the model's inside, not only by a prefix: they match once"
            f" {'; '.join(changes)}. With `rename={self.expression()}`, {self.matched} of the model's {total} tensors"
            f" load.{partial} {_RENAME_USAGE}"
        )


def _inner_rename(
    targets: Sequence[TargetSpec], specs: Mapping[str, TensorSpec], matched_now: int
) -> InnerRename | None:
    """The rename that inserts or substitutes whole name components consistently, if it loads more than a prefix.

    A wrapper inserts components (peft: ``q_proj.weight`` is ``q_proj.base_layer.weight``, ``lora_A.weight`` is
    ``lora_A.default.weight``) or a model renames one (``block_sparse_moe`` is ``mlp``): each model tensor that the
    checkpoint lacks is compared with the checkpoint's names, with one or two components left out of the model's name,
    or one component in another place, and counted where the shapes agree. The edits found for the most tensors
    become ``str.replace`` calls, after the prefix change that matches the most names; the result is checked (no two
    names collide, no exact name changes).

    """
    names = list(specs)
    shapes = {target.names[0]: target.shape for target in targets}
    best, best_matched = _best_candidate(targets, names, depth=2)
    if best_matched <= _matched(targets, set(names)):
        best, best_matched = None, _matched(targets, set(names))
    prefixed = {(_rename_one(name, best) if best else name): name for name in names}
    if len(prefixed) != len(names) or any(value is None for value in prefixed):
        return None
    target_names = {name for target in targets for name in target.names}
    unmatched = set(prefixed) - target_names
    missing = [target.names[0] for target in targets if not any(name in prefixed for name in target.names)]
    if not unmatched or not missing:
        return None
    by_context: dict[tuple[int, tuple[str, ...], tuple[str, ...]], set[str]] = {}
    for name in unmatched:
        parts = tuple(name.split("."))
        for index in range(len(parts) - 1):
            by_context.setdefault((index, parts[:index], parts[index + 1 :]), set()).add(parts[index])
    edits: Counter[tuple[str, str]] = Counter()
    for name in missing:
        parts = tuple(name.split("."))
        for index in range(1, len(parts) - 1):
            for width in (1, 2):
                shorter = ".".join(parts[:index] + parts[index + width :])
                if (
                    index + width < len(parts)
                    and shorter in unmatched
                    and specs[prefixed[shorter]].shape == shapes[name]
                ):
                    before, inserted = parts[index - 1], ".".join(parts[index : index + width])
                    edits[(f".{before}.", f".{before}.{inserted}.")] += 1
            others = by_context.get((index, parts[:index], parts[index + 1 :]), set()) - {parts[index]}
            if len(others) == 1:
                other = others.pop()
                source = ".".join((*parts[:index], other, *parts[index + 1 :]))
                if specs[prefixed[source]].shape == shapes[name]:
                    edits[(f".{other}.", f".{parts[index]}.")] += 1
    chosen: dict[str, str] = {}
    for (old, new), _ in edits.most_common():
        if old not in chosen and len(chosen) < SHOWN_NAMES:
            chosen[old] = new
    if not chosen:
        return None
    candidate = InnerRename(best, tuple(chosen.items()), 0, [])
    renamed = {candidate(name): name for name in names}
    if len(renamed) != len(names) or any(candidate(name) != name for name in names if name in target_names):
        return None
    matched = _matched(targets, set(renamed))
    if matched <= max(matched_now, best_matched):
        return None
    left = [target.names[0] for target in targets if not any(name in renamed for name in target.names)]
    extra = [original for new, original in renamed.items() if new not in target_names]
    return InnerRename(best, tuple(chosen.items()), matched, left, extra)


def _best_candidate(
    targets: Sequence[TargetSpec], names: list[str], depth: int = 1
) -> tuple[dict[str, str] | None, int]:
    """The prefix change that matches the most model tensors; ``depth=2`` also tries two-component prefixes."""
    best: dict[str, str] | None = None
    best_matched = 0
    candidates = _candidates(targets, names)
    if depth > 1:
        removed = [p for p in _common_prefixes(names, depth) if {p: ""} not in candidates]
        added = [p for p in _common_prefixes((t.names[0] for t in targets), depth) if {"": p} not in candidates]
        candidates += [{prefix: ""} for prefix in removed] + [{"": prefix} for prefix in added]
    for candidate in candidates:
        renamed = _with_prefix(names, candidate)
        matched = _matched(targets, renamed) if renamed is not None else 0
        if matched > best_matched:
            best, best_matched = candidate, matched
    return best, best_matched


def _leaving_out(plan: NamePlan) -> dict[str, str | None] | None:
    """``plan.aligned`` plus the prefixes that leave out the unexpected tensors, if a few prefixes do so safely."""
    used = set(plan.sources.values())
    groups = dict.fromkeys(name.split(".", 1)[0] + "." if "." in name else name for name in plan.unexpected)
    if len(groups) > SHOWN_NAMES or any(name.startswith(group) for group in groups for name in used):
        return None
    return {**plan.aligned, **dict.fromkeys(groups)}


def _describe(aligned: Mapping[str, str]) -> str:
    (removed, added), *_ = aligned.items()
    return f"the prefix {removed!r} is removed from them" if removed else f"the prefix {added!r} is added to them"


def _shape(shape: tuple[int, ...]) -> str:
    return f"({', '.join(map(str, shape))})" if len(shape) != 1 else f"({shape[0]},)"
