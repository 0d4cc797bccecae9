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
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch.nn import Module

from lightning_fsdp.core.fsdp import _Layout, _match_module_state
from lightning_fsdp.layouts.targets import TargetSpec, clean_name, names_layout
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
    extra_sources: dict[str, str] = field(default_factory=dict)
    """Name of a module's extra state (``<module>._extra_state``) -> the name of the checkpoint entry that sets it."""
    missing_extra: list[str] = field(default_factory=list)
    """The model's extra states that the checkpoint does not hold."""
    unexpected_extra: list[str] = field(default_factory=list)
    """The checkpoint's extra states that no module of the model takes, by their names in the file."""

    @property
    def all_missing(self) -> list[str]:
        """The missing names, tensors' and extra states' alike, as ``load_state_dict`` counts them."""
        return [*self.missing, *self.missing_extra]

    @property
    def all_unexpected(self) -> list[str]:
        """The unexpected names, tensors' and extra states' alike, as ``load_state_dict`` counts them."""
        return [*self.unexpected, *self.unexpected_extra]

    def skipped_summary(self) -> str:
        parts = []
        missing, unexpected = self.missing, self.all_unexpected
        if missing:
            parts.append(
                f"{len(missing)} missing key(s) left as they were ({quoted_names(missing)}): they keep the"
                " values they had before the load, from the model's initialisation (none, with"
                " `init_module(empty_init=True)` and no initialisation that writes them: a warning names those)"
            )
        if self.missing_extra:
            extra = self.missing_extra
            parts.append(f"{len(extra)} missing extra state(s) left as they were ({quoted_names(extra)})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected key(s) ignored ({quoted_names(unexpected)})")
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
    extra_states: Mapping[str, Module] | None = None,
    extra_entries: Collection[str] = (),
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
    ``extra_states`` (the core's :func:`~lightning_fsdp.core.fsdp._extra_states`) are the model's modules with an
    extra state (``get_extra_state``) and ``extra_entries`` the names of the checkpoint's; they are matched by the
    core's matching under the same rename: a missing one is a strict error and an unexpected one too, as in
    :meth:`torch.nn.Module.load_state_dict`.

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
    _match_extra_states(plan, extra_states or {}, extra_entries, plan.aligned if rename is None else rename)

    missing, unexpected = plan.all_missing, plan.all_unexpected
    problems = name_problems(missing, unexpected) if strict else []
    if shape_mismatches:
        problems.append(f"{len(shape_mismatches)} shape mismatch(es): {shown_items(shape_mismatches)}")
    if dtype_mismatches:
        problems.append(
            f"{len(dtype_mismatches)} dtype mismatch(es) that cannot be cast: {shown_items(dtype_mismatches)}"
        )
    if not problems and not plan.sources and targets:
        problems.append(f"no checkpoint tensor matches a model tensor (checkpoint keys: {quoted_names(list(specs))})")
    from lightning_fsdp.loading.rename_advice import _rename_fixes  # imported here: it imports this module

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
            fixes.append(strict_false_fix(plan.missing, plan.missing_extra))
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


def _match(
    targets: Sequence[TargetSpec], specs: Mapping[str, TensorSpec], originals: Mapping[str, str]
) -> tuple[NamePlan, list[str], list[str]]:
    """The plan for the checkpoint's tensors under new names (``originals``: new name -> name in the file).

    Which tensor feeds which, and which are unexpected, is the core's matching
    (:func:`lightning_fsdp.core.fsdp._match_module_state`, as ``load_state_dict`` counts names); a model tensor is
    missing only where none of its tied names is in the checkpoint. Then shapes and dtypes are compared.

    """
    plan = NamePlan()
    shape_mismatches: list[str] = []
    dtype_mismatches: list[str] = []
    fed, _, unexpected = _match_module_state(originals, names_layout(targets))
    for target in targets:
        new_name = fed.get(target.names[0])
        if new_name is None:
            plan.missing.append(target.names[0])
            continue
        source_name = originals[new_name]
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
    plan.unexpected = [originals[name] for name in unexpected]
    return plan, shape_mismatches, dtype_mismatches


def _match_extra_states(
    plan: NamePlan, extra_states: Mapping[str, Module], entries: Collection[str], rename: Rename
) -> None:
    """Which checkpoint entry sets each of the model's extra states, by the core's matching, under ``rename``."""
    originals = _renamed(entries, rename)
    _, plan.missing_extra, unexpected = _match_module_state(originals, _Layout({}, {}, {}, [], dict(extra_states)))
    plan.unexpected_extra = [originals[name] for name in unexpected]
    plan.extra_sources = {name: originals[name] for name in extra_states if name in originals}


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
    """Primary target name -> the checkpoint tensor (its name in the file) that feeds it, by the core's matching."""
    fed, _, _ = _match_module_state(originals, names_layout(targets))
    return {target: originals[new_name] for target, new_name in fed.items()}


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


def _renamed(specs: Iterable[str], rename: Rename) -> dict[str, str]:
    """New name -> the name in the file, for every tensor (name in ``specs``) that ``rename`` keeps."""
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


def name_problems(missing: Sequence[str], unexpected: Sequence[str]) -> list[str]:
    """The lines of a strict error for the missing and unexpected names (of a checkpoint file or directory)."""
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing key(s), in the model but not the checkpoint: {quoted_names(missing)}")
    if unexpected:
        problems.append(
            f"{len(unexpected)} unexpected key(s), in the checkpoint but not the model: {quoted_names(unexpected)}"
        )
    return problems


def strict_false_fix(missing: Sequence[str], missing_extra: Sequence[str] = ()) -> str:
    """The fix that a strict error gives where ``strict=False`` would load the rest."""
    return f"To load only the tensors that match, {_leaving(missing, missing_extra)}pass `strict=False`."


def _leaving(missing: Sequence[str], missing_extra: Sequence[str] = ()) -> str:
    """The clause that names what of the model ``strict=False`` would leave as it was (empty if nothing)."""
    left = []
    if missing:
        left.append(f"{len(missing)} missing tensor(s) ({quoted_names(missing)})")
    if missing_extra:
        left.append(f"{len(missing_extra)} missing extra state(s) ({quoted_names(missing_extra)})")
    return f"leaving the model's {' and '.join(left)} as they were, " if left else ""


def _describe(aligned: Mapping[str, str]) -> str:
    (removed, added), *_ = aligned.items()
    return f"the prefix {removed!r} is removed from them" if removed else f"the prefix {added!r} is added to them"


def _shape(shape: tuple[int, ...]) -> str:
    return f"({', '.join(map(str, shape))})" if len(shape) != 1 else f"({shape[0]},)"
