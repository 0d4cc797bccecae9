"""The rank process: set up Fabric and the model, load with this project or upstream, and check every shard."""

from __future__ import annotations

import gc
import json
import os
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .checkpoints import ADAM_LR, ADAM_STEP, Block, Model, _checksum
from .sampler import _read_fields, _read_io, _write_proc

#: The implementations that run Lightning's own strategies: the installed release, and master from its source tree.
_LIGHTNING_IMPLEMENTATIONS = ("upstream", "master-s3")


def _fsdp_on_cpu(base: type) -> type:
    """``base`` (Lightning's ``FSDPStrategy`` or the core's) with the smallest change that lets it run on CPU.

    Lightning 2.6.6 wraps with ``device_id=self.root_device.index``, which is ``None`` on CPU, and FSDP then looks for a
    CUDA device. This subclass passes the CPU device instead, as Lightning master does. Everything else,
    ``load_checkpoint`` in particular (what is measured), is ``base``'s, untouched. (Lightning's ``Fabric`` refuses
    ``FSDPStrategy`` on CPU only for the class itself, not for subclasses.)
    """

    class FSDPStrategyOnCPU(base):
        def setup_module(self, module: nn.Module) -> nn.Module:
            from torch.distributed.fsdp import FullyShardedDataParallel

            return FullyShardedDataParallel(
                module=module,
                cpu_offload=self.cpu_offload,
                mixed_precision=self.mixed_precision_config,
                sharding_strategy=self.sharding_strategy,
                device_id=self.root_device,
                **self._fsdp_kwargs,
            )

    FSDPStrategyOnCPU.__qualname__ = FSDPStrategyOnCPU.__name__ = f"{base.__name__}OnCPU"
    return FSDPStrategyOnCPU


def _parallelize(model: Model, device_mesh: Any) -> Model:
    """FSDP2: ``fully_shard`` each block, then the root (the final LayerNorm), over the data-parallel dimension."""
    from torch.distributed.fsdp import fully_shard

    mesh = device_mesh["data_parallel"]
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _make_strategy(cfg: dict[str, Any]) -> Any:
    kwargs = {} if cfg["load_concurrency"] is None else {"load_concurrency": cfg["load_concurrency"]}
    implementation = cfg["implementation"]
    if cfg["strategy"] == "fsdp2":
        if implementation in _LIGHTNING_IMPLEMENTATIONS:
            # Upstream's class runs on CPU as it is: it builds its device mesh for the CPU device and uses gloo.
            from lightning.fabric.strategies import ModelParallelStrategy
        elif implementation == "core":
            from lightning_fsdp.core.model_parallel import ModelParallelStrategy
        else:
            from lightning_fsdp import ModelParallelStrategy
        world_size = cfg["ranks_per_node"] * cfg["nodes"]
        return ModelParallelStrategy(
            _parallelize,
            data_parallel_size=world_size,
            tensor_parallel_size=1,
            save_distributed_checkpoint=False,
            **kwargs,
        )
    if implementation in _LIGHTNING_IMPLEMENTATIONS or implementation == "core":
        if implementation == "core":
            from lightning_fsdp.core.fsdp import FSDPStrategy as LightningFSDPStrategy
        else:
            from lightning.fabric.strategies import FSDPStrategy as LightningFSDPStrategy
        if cfg.get("device") == "cuda":  # the class as it is: on a GPU it needs no change
            return LightningFSDPStrategy(auto_wrap_policy={Block})
        return _fsdp_on_cpu(LightningFSDPStrategy)(auto_wrap_policy={Block})
    from lightning_fsdp import FSDPStrategy

    return FSDPStrategy(auto_wrap_policy={Block}, **kwargs)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: the local shard of a ``DTensor`` (FSDP2), the tensor itself otherwise (FSDP1)."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def _optimizer_state_bytes(optimizer: Any) -> int:
    """What Adam's state takes on this rank once loaded: ``exp_avg`` and ``exp_avg_sq`` of every local parameter shard,
    in the parameter's dtype, and a 0-d fp32 ``step`` per parameter. Any load of the optimizer must allocate this."""
    from lightning.fabric.wrappers import _unwrap_objects

    params = [p for group in _unwrap_objects(optimizer).param_groups for p in group["params"]]
    return sum(2 * _local(p).numel() * p.element_size() + 4 for p in params)


def _allocated_optimizer_state_bytes(optimizer: Any) -> int:
    """What the loaded Adam state takes on this rank, tensor by tensor (a cross-check of the figure above)."""
    from lightning.fabric.wrappers import _unwrap_objects

    states = _unwrap_objects(optimizer).state.values()
    return sum(_local(v).numel() * v.element_size() for s in states for v in s.values() if isinstance(v, torch.Tensor))


def _load(cfg: dict[str, Any], fabric: Any, model: nn.Module, optimizer: Any) -> None:
    """The call under measurement: each implementation's best public way to load this format."""
    path = Path(cfg["path"])
    state = {"model": model} if optimizer is None else {"model": model, "optimizer": optimizer}
    trusted = {} if cfg["weights_only"] else {"weights_only": False}
    if cfg["implementation"] == "master-s3":
        # Lightning master's own remote path (`cloud_io._load`: `torch.load` of the object through fsspec).
        if cfg["format"] == "full":
            fabric.load(cfg["remote_url"], state, **trusted)
        else:
            fabric.load_raw(cfg["remote_url"], model)
    elif cfg["remote_url"]:
        with fabric.strategy.load_options(storage_options=cfg["storage_options"]):
            fabric.load(cfg["remote_url"], state, **trusted)
    elif cfg["implementation"] != "upstream" or cfg["format"] == "full":
        fabric.load(path, state, **trusted)
    elif cfg["format"] == "zip":
        fabric.load_raw(path, model)
    elif cfg["format"] in ("legacy", "legacy-fabric"):
        # Upstream's `load_raw` reads with `torch.load(mmap=True)`, which refuses legacy pickles. What a user can do
        # instead: `torch.load` on every rank, then what `load_raw` does with the state dict (upstream's own function).
        from lightning.fabric.strategies.model_parallel import _load_raw_module_state
        from lightning.fabric.wrappers import _unwrap_objects

        state_dict = torch.load(path, map_location="cpu", weights_only=cfg["weights_only"])
        if cfg["format"] == "legacy-fabric":
            state_dict = state_dict["model"]
        _load_raw_module_state(state_dict, module=_unwrap_objects(model), world_size=fabric.world_size)
        del state_dict
    else:
        raise ValueError(f"upstream cannot load the {cfg['format']!r} format")


def _create_s3_client(cfg: dict[str, Any]) -> None:
    """Import s3fs and create the client the load will use (fsspec keeps one per thread and options): what a job that
    already talked to the store holds before it loads. One ``HEAD`` request of the object."""
    from lightning_fsdp.loading.remote import remote_path

    remote_path(cfg["remote_url"], cfg["storage_options"]).stat()


def _own_parameters(unit: nn.Module) -> dict[str, torch.Tensor]:
    """The original parameters that this FSDP unit manages (not those of nested units), by their name in the unit."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    found: dict[str, torch.Tensor] = {}

    def visit(module: nn.Module, prefix: str) -> None:
        for name, param in module.named_parameters(recurse=False):
            if name != "_flat_param":
                found[prefix + name] = param
        for name, child in module.named_children():
            if not isinstance(child, FullyShardedDataParallel):
                visit(child, f"{prefix}{name}.")

    visit(unit, "")
    return found


def _clean_name(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")


def _verify(cfg: dict[str, Any], fabric: Any, model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """Checksums of the loaded parameters (this rank's share of them) and an exact check of the local Adam state.

    FSDP1: each FSDP unit is unsharded alone (``summon_full_params(unit, recurse=False)``), so the check costs one unit
    per rank, not the model. FSDP2: each ``DTensor`` parameter is gathered alone (``full_tensor()``), one at a time.
    Either way the full tensor is the ranks' local shards put together, so a shard that holds the wrong slice of the
    source changes the position-weighted checksum. Every rank checks its own local Adam state against its own local
    parameter shard.

    """
    from lightning.fabric.wrappers import _unwrap_objects

    root = _unwrap_objects(model)
    order = {name: index for index, name in enumerate(cfg["key_order"])}
    if cfg["strategy"] == "fsdp2":
        checksums = _dtensor_checksums(root, order, fabric.world_size, fabric.global_rank)
    else:
        checksums = _flat_parameter_checksums(root, order, fabric.world_size, fabric.global_rank)
    result: dict[str, Any] = {"checksums": checksums}
    if optimizer is not None:
        optimizer = _unwrap_objects(optimizer)
        checked, problems = 0, []
        for group in optimizer.param_groups:
            for param in group["params"]:
                local = _local(param).detach().reshape(-1)
                if local.numel() == 0:
                    continue
                state = optimizer.state.get(param, {})
                expected = {"exp_avg": local * 0.5, "exp_avg_sq": local * local}
                for key, value in expected.items():
                    if key not in state or not torch.equal(_local(state[key]).reshape(-1), value):
                        problems.append(f"{key} of a parameter of {tuple(param.shape)}")
                if "step" not in state or float(_local(state["step"])) != ADAM_STEP:
                    problems.append("step")
                checked += 1
        result["optimizer_checked"] = checked
        result["optimizer_problems"] = problems[:5]
    return result


def _dtensor_checksums(
    root: nn.Module, order: dict[str, int], world_size: int, rank: int
) -> dict[str, tuple[float, float, float]]:
    checksums = {}
    for name, param in root.named_parameters():  # the same order on every rank: `full_tensor` is a collective
        full = param.full_tensor() if hasattr(param, "full_tensor") else param
        if order.get(name, -1) % world_size == rank:
            checksums[name] = _checksum(full)
        del full
    return checksums


def _flat_parameter_checksums(
    root: nn.Module, order: dict[str, int], world_size: int, rank: int
) -> dict[str, tuple[float, float, float]]:
    from torch.distributed.fsdp import FullyShardedDataParallel

    checksums: dict[str, tuple[float, float, float]] = {}
    for unit_name, unit in root.named_modules():
        if not isinstance(unit, FullyShardedDataParallel):
            continue
        with FullyShardedDataParallel.summon_full_params(unit, recurse=False, writeback=False):
            for name, param in _own_parameters(unit).items():
                full_name = _clean_name(f"{unit_name}.{name}" if unit_name else name)
                if order.get(full_name, -1) % world_size == rank:
                    checksums[full_name] = _checksum(param)
    return checksums


def _reset_peak_rss() -> bool:
    """Reset the kernel's high-water mark of this process's RSS (``VmHWM``) to its current RSS."""
    return _write_proc("/proc/self/clear_refs", "5")


def run_worker(cfg_path: str) -> int:
    cfg = json.loads(Path(cfg_path).read_text())
    rank = int(os.environ["NODE_RANK"]) * cfg["ranks_per_node"] + int(os.environ["LOCAL_RANK"])
    out = Path(cfg["run_dir"]) / f"rank-{rank}.json"
    result: dict[str, Any] = {"rank": rank, "phase": "setup"}
    try:
        from lightning.fabric import Fabric

        fabric = Fabric(
            accelerator=cfg.get("device", "cpu"),
            devices=cfg["ranks_per_node"],
            num_nodes=cfg["nodes"],
            strategy=_make_strategy(cfg),
        )
        fabric.launch()
        with fabric.init_module(empty_init=True):
            model = Model(cfg["width"], cfg["depth"])
        model = fabric.setup_module(model)
        optimizer = None
        if cfg["format"] == "full":
            # Right after `setup_module`, before any forward (FSDP2 keeps the root's parameters gathered after one).
            optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=ADAM_LR))
            result["optimizer_state_bytes"] = _optimizer_state_bytes(optimizer)
        if cfg["implementation"] == "s3-client-in-base":
            _create_s3_client(cfg)
        gc.collect()
        fabric.barrier()
        result["t_base_start"] = time.monotonic()
        time.sleep(cfg["settle"])
        fabric.barrier()
        result["t_base_end"] = time.monotonic()

        result["phase"] = "load"
        fabric.barrier()
        result["peak_rss_reset"] = _reset_peak_rss()
        gpu = fabric.device if fabric.device.type == "cuda" else None
        if gpu is not None:
            torch.cuda.synchronize(gpu)
            torch.cuda.reset_peak_memory_stats(gpu)
            result["gpu_base"] = torch.cuda.memory_allocated(gpu)
        io_before = _read_io()
        result["t_load_start"] = start = time.monotonic()
        _load(cfg, fabric, model, optimizer)
        if gpu is not None:
            torch.cuda.synchronize(gpu)  # the copies to the GPU are part of the load
        fabric.barrier()
        result["t_load_end"] = end = time.monotonic()
        if gpu is not None:
            result["gpu_peak"] = torch.cuda.max_memory_allocated(gpu)
            result["gpu_after"] = torch.cuda.memory_allocated(gpu)
        io_after = _read_io()
        if io_before and io_after:
            result["io"] = {key: io_after[key] - io_before[key] for key in io_before}
        result["load_seconds"] = end - start
        if cfg["remote_url"] and cfg["implementation"] != "master-s3":
            from lightning_fsdp.loading.files import fetched_bytes

            result["fetched"] = fetched_bytes()
        result["peak_rss"] = 1024 * (_read_fields("/proc/self/status", ("VmHWM",)) or {}).get("VmHWM", 0)
        if optimizer is not None:
            result["optimizer_state_allocated"] = _allocated_optimizer_state_bytes(optimizer)

        result["phase"] = "after load"
        time.sleep(cfg["settle"])
        fabric.barrier()
        result["t_after_end"] = time.monotonic()
        result["phase"] = "verify"
        result.update(_verify(cfg, fabric, model, optimizer))
        fabric.barrier()
        result["phase"] = "done"
    except BaseException as error:
        result["error"] = f"{type(error).__name__}: {error}"
        result["traceback"] = traceback.format_exc()
        out.write_text(json.dumps(result))
        raise
    out.write_text(json.dumps(result))
    return 0
