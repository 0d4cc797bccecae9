"""The advice that a failed name plan's error gives: the ``rename`` that would make the checkpoint's names load.

Where no single prefix maps the names, :func:`_rename_fixes` looks for an :class:`InnerRename` (consistent insertions
or substitutions of name components, peft's ``base_layer`` or ``lora_A.default``, counted where the shapes agree), a
:class:`PairedRename` (model tensors that the checkpoint holds under other names, paired by shape and dtype one to one)
or the prefix change that matches the most tensors, and words it as a ``rename`` to paste. The plan itself is
:func:`lightning_fsdp.loading.validation.plan_load`'s; this module runs only once it has failed.

Layer: an extension of the package (docs/source-fabric/upstream.rst), not part of the core.
"""

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_fsdp.layouts.targets import TargetSpec
from lightning_fsdp.loading.errors import SHOWN_NAMES, quoted_names
from lightning_fsdp.loading.sources import TensorSpec
from lightning_fsdp.loading.validation import (
    _RENAME_USAGE,
    NamePlan,
    Rename,
    _candidates,
    _common_prefixes,
    _describe,
    _match,
    _matched,
    _rename_one,
    _renamed,
    _with_prefix,
)


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
