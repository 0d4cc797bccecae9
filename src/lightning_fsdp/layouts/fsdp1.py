"""The FSDP1 layout: which slice of every tensor each rank holds in a ``FullyShardedDataParallel`` module.

FSDP (``FullyShardedDataParallel``) flattens the parameters of each wrapped unit into one ``FlatParameter`` and keeps a
contiguous shard of it per rank. Which elements of which tensor a rank holds is the core's answer
(:func:`lightning_fsdp.core.fsdp._fsdp_layout`, from FSDP's ``_shard_param_infos``), which :func:`collect_targets`
turns into the targets of :mod:`lightning_fsdp.layouts.targets`. The FSDP2 (``fully_shard``, ``DTensor``) layout is in
:mod:`lightning_fsdp.layouts.fsdp2`.

Layer: shared infrastructure (``lightning_fsdp.layouts``), used by loading and saving; not part of the core.
"""

from torch.nn import Module

from lightning_fsdp.core.fsdp import _fsdp_layout
from lightning_fsdp.layouts.targets import ModuleTargets, OptimizerParam, Run, ShardLocalUnsupported, Target, clean_name

_FLAT_PARAM_ATTRIBUTES = ("_fqns", "_shapes", "_shard_param_infos", "_shared_param_infos")


def collect_targets(module: Module) -> ModuleTargets:
    """The FSDP1 layout: every tensor of ``module`` that a checkpoint fills, with the slice of it this rank holds.

    The layout is the core's (:func:`lightning_fsdp.core.fsdp._fsdp_layout`), read from FSDP's ``_shard_param_infos``;
    this adds the checks that let the loader fall back instead, and the targets and optimizer parameters of the copy.

    Raises:
        ShardLocalUnsupported: If a unit is unsharded right now or FSDP's flat parameters lack the metadata this
            path relies on (another torch release): the caller falls back to FSDP's own state-dict loading.
        CheckpointLoadError: If a tensor is still on the meta device (the module was not set up).

    """
    _check_flat_params(module)
    layout = _fsdp_layout(module)
    collected = ModuleTargets(param_names=layout.param_names)
    targets: dict[str, Target] = {}
    for name, shard in layout.shards.items():
        if not isinstance(shard.index, int):  # a tensor that FSDP does not shard: copied whole
            target = Target([name], tuple(shard.shape), shard.local.dtype, tensor=shard.local)
        else:
            runs = [Run(shard.index, shard.local.numel(), 0)] if shard.local.numel() else []
            target = Target([name], tuple(shard.shape), shard.local.dtype, local=shard.local, runs=runs)
        targets[name] = target
        collected.targets.append(target)
    for alias, primary in layout.tied.items():
        if primary not in targets:
            raise ShardLocalUnsupported(f"the tied parameter {primary!r} was not found in its FSDP unit")
        targets[primary].names.append(alias)
    for param in module.parameters():
        core_param = layout.params.get(id(param))
        if core_param is None:
            continue
        parts = [
            (targets[piece.name], [Run(piece.index, piece.numel, piece.offset)] if piece.numel else [])
            for piece in core_param.pieces
        ]
        # the core's answer, how the state is shaped included: an original parameter with no element on this rank
        # keeps no optimizer state here
        collected.optimizer_params[id(param)] = OptimizerParam(
            core_param.numel, parts, core_param.to_state, core_param.stateful
        )
    collected.check_materialized()
    return collected


def _check_flat_params(module: Module) -> None:
    """Raise :class:`ShardLocalUnsupported` where writing into the units' local shards would not reach the model."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    for module_name, submodule in module.named_modules():
        if not isinstance(submodule, FullyShardedDataParallel) or submodule._handle is None:
            continue
        handle = submodule._handle
        flat_param = handle.flat_param
        missing = [attr for attr in _FLAT_PARAM_ATTRIBUTES if not hasattr(flat_param, attr)]
        if missing:
            raise ShardLocalUnsupported(f"FSDP's flat parameters in this torch release lack {', '.join(missing)}")
        # FSDP creates `_local_shard` lazily, at the first forward; until then `data` is the shard
        local_shard = getattr(flat_param, "_local_shard", None)
        if local_shard is not None and (
            flat_param.data.data_ptr() != local_shard.data_ptr()
            or (handle.uses_sharded_strategy and not handle.needs_unshard())
        ):
            # FSDP would reuse its unsharded copy (SHARD_GRAD_OP keeps it after a forward without backward) instead
            # of gathering the shards again, and never see what is written into them.
            raise ShardLocalUnsupported(
                f"the FSDP unit {clean_name(module_name) or '<root>'!r} holds an unsharded copy of its parameters at"
                " the moment (after a forward without backward, or inside forward and backward)"
            )
