"""Model tensors assembled from several checkpoint tensors, as a model's declared weight conversions say.

A transformers 5 Mixture-of-Experts model holds its experts fused (``mlp.experts.gate_up_proj``, one tensor of all
experts) while ``save_pretrained`` and the Hub hold one tensor per expert (``block_sparse_moe.experts.3.w1.weight``).
``from_pretrained`` converts them with the conversions that the model declares (``transformers.conversion_mapping``:
``WeightRenaming``, and ``WeightConverter`` with ``MergeModulelist``, ``Concatenate``, ``Transpose``).
:func:`with_declared_conversions` reads the same declarations, names the checkpoint's tensors as transformers would
(transformers' own ``rename_source_key``, its key order), evaluates the operations on shapes only, and returns a
:class:`ConvertedSource`: a source that holds each converted tensor under its model name, as **pieces** (a checkpoint
tensor and the box of the target that it fills). A range of the flattened target maps to ranges of its pieces, so a
rank reads only the parts of the checkpoint tensors that fall in its slice (stacking experts along dimension 0 gives
each expert one contiguous block; concatenating along a later dimension gives strided blocks). A piece that a
``Transpose`` moved is read whole, once per range that needs it, and transposed in memory: the declared conversions of
the Mixture-of-Experts families use none.

Layer: an extension of the package (docs/source-fabric/upstream.rst), not part of the core.
"""

import bisect
import functools
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch.nn import Module

from lightning_fsdp.layouts.fsdp2 import index_runs
from lightning_fsdp.layouts.targets import TargetSpec
from lightning_fsdp.loading.errors import CheckpointLoadError
from lightning_fsdp.loading.sources import TensorSource, TensorSpec

_SHOWN = 3


@dataclass(frozen=True)
class Piece:
    """A checkpoint tensor that fills a box of a target: ``offset`` and ``size`` per target dimension.

    ``source_dims[i]`` is the checkpoint tensor's dimension that target dimension ``i`` runs along, or ``None`` for a
    dimension of size 1 that stacking inserted.
    """

    name: str
    offset: tuple[int, ...]
    size: tuple[int, ...]
    source_dims: tuple[int | None, ...]

    @property
    def in_order(self) -> bool:
        """Whether the box's row-major order is the checkpoint tensor's (no transpose): then it is read by ranges."""
        dims = [dim for dim in self.source_dims if dim is not None]
        return dims == sorted(dims)


@dataclass(frozen=True)
class _Symbolic:
    """A tensor known by its shape and the pieces it is made of (the result of conversion operations on shapes)."""

    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]


@dataclass(frozen=True)
class _Segment:
    """``count`` elements of the flattened target from ``start`` are elements ``position`` on of piece ``piece``."""

    start: int
    count: int
    piece: int
    position: int


@dataclass(frozen=True)
class Composite:
    """A target tensor assembled from pieces: its spec, the pieces, and the segments that map its flat elements."""

    spec: TensorSpec
    pieces: tuple[Piece, ...]
    segments: tuple[_Segment, ...]

    @property
    def starts(self) -> list[int]:
        return [segment.start for segment in self.segments]


class ConvertedSource(TensorSource):
    """A source that holds converted tensors under their model names, read piece by piece from ``base``.

    The checkpoint tensors that a conversion consumes are not listed; every other tensor is passed through.

    """

    def __init__(self, base: TensorSource, composites: Mapping[str, Composite]) -> None:
        self._base = base
        self.composites = dict(composites)
        consumed = {piece.name for composite in self.composites.values() for piece in composite.pieces}
        self._specs = {name: spec for name, spec in base.specs().items() if name not in consumed}
        self._specs.update({name: composite.spec for name, composite in self.composites.items()})
        self._starts = {name: composite.starts for name, composite in self.composites.items()}

    def specs(self) -> Mapping[str, TensorSpec]:
        return self._specs

    def read(self, name: str) -> torch.Tensor:
        composite = self.composites.get(name)
        if composite is None:
            return self._base.read(name)
        out = torch.empty(composite.spec.numel, dtype=composite.spec.dtype)
        self.read_flat_into(name, 0, out)
        return out.view(composite.spec.shape)

    def read_flat(self, name: str, start: int, stop: int) -> torch.Tensor:
        composite = self.composites.get(name)
        if composite is None:
            return self._base.read_flat(name, start, stop)
        stop = min(stop, composite.spec.numel)
        start = min(max(start, 0), stop)
        out = torch.empty(stop - start, dtype=composite.spec.dtype)
        self.read_flat_into(name, start, out)
        return out

    def read_flat_into(self, name: str, start: int, out: torch.Tensor) -> None:
        composite = self.composites.get(name)
        if composite is None:
            self._base.read_flat_into(name, start, out)
            return
        stop = start + out.numel()
        if start < 0 or stop > composite.spec.numel:
            raise ValueError(f"elements [{start}, {stop}) are outside the tensor {name!r}")
        flat = out.view(-1)
        first = max(bisect.bisect_right(self._starts[name], start) - 1, 0)
        boxes: dict[int, torch.Tensor] = {}
        for segment in composite.segments[first:]:
            if segment.start >= stop:
                break
            low, high = max(start, segment.start), min(stop, segment.start + segment.count)
            if low >= high:
                continue
            destination = flat[low - start : high - start]
            position = segment.position + low - segment.start
            piece = composite.pieces[segment.piece]
            if piece.in_order:
                self._base.read_flat_into(piece.name, position, destination)
            else:
                if segment.piece not in boxes:
                    boxes[segment.piece] = _box(self._base.read(piece.name), piece)
                destination.copy_(boxes[segment.piece][position : position + high - low])

    def check_unchanged(self) -> None:
        self._base.check_unchanged()

    def close(self) -> None:
        self._base.close()


def with_declared_conversions(module: Module, source: TensorSource, targets: Sequence[TargetSpec]) -> TensorSource:
    """``source`` with the conversions that the transformers model in ``module`` declares applied to its names.

    A checkpoint tensor named exactly as a model tensor is never converted, and a converted tensor whose name the
    checkpoint already holds is left out (an exact name wins). Returns ``source`` itself when ``module`` holds no
    transformers model, the model declares no conversions, or none applies to this checkpoint.

    Raises:
        CheckpointLoadError: If a declared conversion applies to this checkpoint but uses an operation that cannot be
            read shard-locally, or its tensors do not fit together.

    """
    transforms = _declared_transforms(module)
    if not transforms:
        return source
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    renamings = [transform for transform in transforms if isinstance(transform, WeightRenaming)]
    converters = [transform for transform in transforms if isinstance(transform, WeightConverter)]
    specs = source.specs()
    target_names = {name for target in targets for name in target.names}
    target_shapes = {name: target.shape for target in targets for name in target.names}
    target_dtypes = {name: target.dtype for target in targets for name in target.names}
    # target name -> (converter or None, source pattern -> checkpoint names, in transformers' order)
    groups: dict[str, tuple[Any, dict[str, list[str]]]] = {}
    for name in sorted(specs, key=dot_natural_key):
        if name in target_names:
            continue
        renamed, pattern = rename_source_key(name, renamings, converters)
        if renamed == name or renamed in specs:
            continue
        converter = next((c for c in converters if pattern is not None and pattern in c.source_patterns), None)
        _, by_pattern = groups.setdefault(renamed, (converter, {}))
        by_pattern.setdefault(pattern or name, []).append(name)
    composites = {}
    lacking: list[str] = []
    for renamed, (converter, by_pattern) in groups.items():
        composite = build_composite(
            renamed, converter, by_pattern, specs, target_shapes.get(renamed), target_dtypes.get(renamed)
        )
        composites[renamed] = composite
        lacking += _experts_lacking(renamed, by_pattern, composite.spec.shape, target_shapes.get(renamed))
    if lacking:
        raise CheckpointLoadError(
            "The checkpoint does not hold the experts that the model has; nothing was loaded and the model is"
            f" unchanged.\n- {chr(10).join(lacking) if len(lacking) <= _SHOWN else _more(lacking)}\nThe checkpoint"
            " was saved from a model with another number of experts, or one of its files is missing: create the model"
            " from the checkpoint's own configuration (`AutoConfig.from_pretrained(path)`), or restore the file."
        )
    return ConvertedSource(source, composites) if composites else source


def _more(items: list[str]) -> str:
    return "\n- ".join(items[:_SHOWN]) + f"\n- ... ({len(items) - _SHOWN} more fused tensor(s))"


def _experts_lacking(
    name: str, by_pattern: Mapping[str, list[str]], shape: tuple[int, ...], expected: tuple[int, ...] | None
) -> list[str]:
    """What the checkpoint lacks (or holds beyond the model) for the fused ``name``, if its expert count differs.

    Each source pattern of a ``MergeModulelist`` holds one ``*``, the expert's index in the checkpoint's names: where
    the assembled shape differs from the model's in one dimension only, and that dimension counts the experts found,
    the model's size there is its number of experts, and the indices it has that the checkpoint lacks are named.

    """
    if expected is None or len(shape) != len(expected) or shape == expected:
        return []
    differing = [dim for dim, (a, b) in enumerate(zip(shape, expected, strict=True)) if a != b]
    if len(differing) != 1:
        return []
    count = expected[differing[0]]
    absent: list[str] = []
    beyond: list[str] = []
    for pattern, names in by_pattern.items():
        if pattern.count("*") != 1:
            return []
        before, after = pattern.split("*")
        regex = re.compile(re.escape(before) + r"(\d+)" + re.escape(after))
        found: dict[int, str] = {}
        for checkpoint_name in names:
            match = regex.search(checkpoint_name)
            if match is None:
                return []
            found[int(match.group(1))] = checkpoint_name
        if len(found) != shape[differing[0]]:
            return []
        template = next(iter(found.values()))
        match = regex.search(template)
        assert match is not None
        absent += [
            template[: match.start(1)] + str(i) + template[match.end(1) :] for i in range(count) if i not in found
        ]
        beyond += [found[i] for i in sorted(found) if i >= count]
    if not absent and not beyond:
        return []
    parts = [f"{name!r}: the model has {count} experts, the checkpoint {shape[differing[0]]}"]
    parts.append(f"(checkpoint {shape}, model {expected})")
    if absent:
        parts.append(f"; the checkpoint lacks {_listed(absent)}")
    if beyond:
        parts.append(f"; the model has no place for {_listed(beyond)}")
    return [" ".join(parts[:2]) + "".join(parts[2:])]


def _declared_transforms(module: Module) -> list[Any]:
    """The transforms that ``from_pretrained`` applies for the transformers model in ``module`` (none without one)."""
    if "transformers" not in sys.modules:  # a model of transformers' was made only after importing it
        return []
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:  # a transformers release without declared conversions (4.x)
        return []
    model = next((submodule for submodule in module.modules() if isinstance(submodule, PreTrainedModel)), None)
    if model is None:
        return []
    try:
        return list(get_model_conversion_mapping(model))
    except Exception as error:  # a model of custom code that transformers cannot read: its names load as they are
        rank_zero_warn(
            f"The weight conversions that {type(model).__name__} declares could not be"
            f" read ({type(error).__name__}: {error}); the checkpoint's names are matched as they are."
        )
        return []


def build_composite(
    name: str,
    converter: Any,
    by_pattern: dict[str, list[str]],
    specs: Mapping[str, TensorSpec],
    expected_shape: tuple[int, ...] | None,
    expected_dtype: torch.dtype | None = None,
) -> Composite:
    """The target ``name`` made by ``converter`` (``None``: a renaming) of the checkpoint tensors ``by_pattern``.

    ``by_pattern`` maps each of the converter's source patterns to the checkpoint names it matched, in transformers'
    order (``dot_natural_key``); ``expected_shape`` is the model's shape of ``name`` (for a ``Transpose`` that checks).
    Pieces of different floating-point dtypes (experts saved in bf16 and float32) are cast to ``expected_dtype``, the
    model's, as ``from_pretrained`` casts each checkpoint tensor to the parameter's dtype before converting.

    """
    leaves = {
        pattern: [_Symbolic(specs[n].shape, (_leaf(n, specs[n]),)) for n in names]
        for pattern, names in by_pattern.items()
    }
    sources = [n for names in by_pattern.values() for n in names]
    if converter is None:  # a renaming: one checkpoint tensor under another name
        if len(sources) > 1:
            raise CheckpointLoadError(
                f"The model's declared renamings give several checkpoint tensors the name {name!r}:"
                f" {_listed(sources)}. Load the checkpoint with `rename=` mapping each to its own model name."
            )
        ((result,),) = leaves.values()
        described = f"renamed from {sources[0]!r}"
    else:
        operations = list(converter.operations)
        described = (
            f"{' then '.join(repr(operation) for operation in operations)} of {_listed(sources)}"
            f" (declared by the model's `{type(converter).__name__}` for {converter.source_patterns})"
        )
        result = _evaluate(name, operations, converter.source_patterns, leaves, described, expected_shape)
    dtypes = {specs[piece.name].dtype for piece in result.pieces}
    if len(dtypes) > 1 and all(dtype.is_floating_point for dtype in dtypes):
        # Each piece is cast as it is read (`read_flat_into` casts into the destination's dtype).
        cast = expected_dtype if expected_dtype is not None and expected_dtype.is_floating_point else None
        dtypes = {cast or functools.reduce(torch.promote_types, dtypes)}
    if len(dtypes) > 1:
        raise CheckpointLoadError(
            f"The checkpoint tensors that make {name!r} ({described}) have different dtypes"
            f" ({', '.join(sorted(map(str, dtypes)))}), so they cannot be assembled into one tensor. Save them with"
            " one dtype."
        )
    segments = []
    for index, piece in enumerate(result.pieces):
        indices = [[range(start, start + size)] for start, size in zip(piece.offset, piece.size, strict=True)]
        segments.extend(_Segment(run.start, run.count, index, run.offset) for run in index_runs(result.shape, indices))
    segments.sort(key=lambda segment: segment.start)
    return Composite(TensorSpec(result.shape, dtypes.pop()), result.pieces, tuple(segments))


def _leaf(name: str, spec: TensorSpec) -> Piece:
    return Piece(name, (0,) * len(spec.shape), spec.shape, tuple(range(len(spec.shape))))


def _evaluate(
    name: str,
    operations: Sequence[Any],
    source_patterns: Sequence[str],
    values: dict[str, list[_Symbolic]],
    described: str,
    expected_shape: tuple[int, ...] | None,
) -> _Symbolic:
    """The operations of a ``WeightConverter`` applied to shapes, as transformers applies them to tensors."""
    from transformers.core_model_loading import Concatenate, MergeModulelist, Transpose

    for operation in operations:
        if isinstance(operation, MergeModulelist):
            values = {pattern: [_stack(name, tensors, operation.dim, described)] for pattern, tensors in values.items()}
        elif isinstance(operation, Concatenate):
            ordered = [tensor for pattern in source_patterns for tensor in values.get(pattern, [])]
            values = {"": [_concatenate(name, ordered, operation.dim, described)]}
        elif isinstance(operation, Transpose) and len(values) == 1:
            (tensor, *_), *_ = values.values()
            swapped = _transpose(tensor, operation.dim0, operation.dim1)
            keep = operation.check_dims and tensor.shape == expected_shape
            values = {"": [tensor if keep else swapped]}
        else:
            raise CheckpointLoadError(
                f"The model declares that {name!r} is made by {described}; the loader cannot read"
                f" `{operation!r}` shard-locally, and loading without it would leave {name!r} uninitialised. Convert"
                " the checkpoint once in one process: `model = AutoModelForCausalLM.from_pretrained(path)`, then"
                " `safetensors.torch.save_file(model.state_dict(), 'converted.safetensors')`, and load that file."
            )
    results = [tensor for tensors in values.values() for tensor in tensors]
    if len(results) != 1:
        raise CheckpointLoadError(
            f"The model declares that {name!r} is made by {described}, which gives {len(results)} tensors, not one:"
            " the loader reads only conversions that assemble one model tensor from checkpoint tensors."
        )
    return results[0]


def _stack(name: str, tensors: list[_Symbolic], dim: int, described: str) -> _Symbolic:
    shapes = {tensor.shape for tensor in tensors}
    if len(shapes) != 1:
        raise _misfit(name, described, f"stacked tensors of different shapes {sorted(shapes)}")
    (shape,) = shapes
    dim = dim % (len(shape) + 1)
    pieces = tuple(
        Piece(
            piece.name,
            (*piece.offset[:dim], index, *piece.offset[dim:]),
            (*piece.size[:dim], 1, *piece.size[dim:]),
            (*piece.source_dims[:dim], None, *piece.source_dims[dim:]),
        )
        for index, tensor in enumerate(tensors)
        for piece in tensor.pieces
    )
    return _Symbolic((*shape[:dim], len(tensors), *shape[dim:]), pieces)


def _concatenate(name: str, tensors: list[_Symbolic], dim: int, described: str) -> _Symbolic:
    ranks = {len(tensor.shape) for tensor in tensors}
    if len(ranks) != 1:
        raise _misfit(name, described, "concatenated tensors of different numbers of dimensions")
    dim = dim % ranks.pop()
    others = {tensor.shape[:dim] + tensor.shape[dim + 1 :] for tensor in tensors}
    if len(others) != 1:
        raise _misfit(name, described, f"concatenated along dimension {dim} tensors of shapes differing elsewhere")
    pieces = []
    position = 0
    for tensor in tensors:
        for piece in tensor.pieces:
            offset = list(piece.offset)
            offset[dim] += position
            pieces.append(Piece(piece.name, tuple(offset), piece.size, piece.source_dims))
        position += tensor.shape[dim]
    shape = list(tensors[0].shape)
    shape[dim] = position
    return _Symbolic(tuple(shape), tuple(pieces))


def _transpose(tensor: _Symbolic, dim0: int, dim1: int) -> _Symbolic:
    def swap(values: tuple[Any, ...]) -> tuple[Any, ...]:
        swapped = list(values)
        swapped[dim0], swapped[dim1] = swapped[dim1], swapped[dim0]
        return tuple(swapped)

    pieces = tuple(Piece(p.name, swap(p.offset), swap(p.size), swap(p.source_dims)) for p in tensor.pieces)
    return _Symbolic(swap(tensor.shape), pieces)


def _box(tensor: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The flattened box that ``piece`` fills, from its whole checkpoint tensor, in the target's order."""
    order = [dim for dim in piece.source_dims if dim is not None]
    return tensor.permute(order).reshape(piece.size).contiguous().view(-1)


def _misfit(name: str, described: str, what: str) -> CheckpointLoadError:
    return CheckpointLoadError(
        f"The checkpoint tensors that make {name!r} ({described}) do not fit together: {what}. The checkpoint does not"
        " match the model's configuration (number or size of experts)."
    )


def _listed(names: Iterable[str]) -> str:
    names = list(names)
    shown = ", ".join(repr(name) for name in names[:_SHOWN])
    return shown + (f", ... ({len(names)} tensors)" if len(names) > _SHOWN else "")
