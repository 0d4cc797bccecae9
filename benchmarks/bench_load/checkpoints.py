"""The synthetic model, its state dict and Adam state, and the checkpoint files of every format."""

from __future__ import annotations

import gc
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .output import _log

# name: (width, depth). A block holds two linears, width x 4*width and 4*width x width, and a LayerNorm.
PRESETS: dict[str, tuple[int, int]] = {
    "tiny": (64, 2),  # 66k parameters, 0.26 MB: seconds, for smoke tests
    "small": (512, 4),  # 8.4M parameters, 34 MB
    "medium": (1024, 8),  # 67M parameters, 268 MB
    "1gb": (2048, 8),  # 268M parameters, 1.07 GB: the anchor of issue 4 (8 blocks of two 2048x8192 linears)
}
FORMATS = ("full", "zip", "legacy", "legacy-fabric", "safetensors", "hf-index")
#: What ``ModelParallelStrategy`` (FSDP2) runs: the formats of issue FSDP2, item 5.
FSDP2_FORMATS = ("full", "zip", "safetensors", "hf-index")
#: Strategy families: Fabric's ``FSDPStrategy`` (FSDP1) and ``ModelParallelStrategy`` (FSDP2, ``fully_shard``).
STRATEGIES = ("fsdp", "fsdp2")
STRATEGY_TITLES = {"fsdp": "FSDP1", "fsdp2": "FSDP2"}
FORMAT_TITLES = {
    "full": "full checkpoint with Adam state",
    "zip": "raw state dict, torch zip file",
    "legacy": "raw state dict, legacy pickle file",
    "legacy-fabric": "Fabric checkpoint {'model': ...}, legacy pickle file",
    "safetensors": "raw state dict, safetensors",
    "hf-index": "raw state dict, Hugging Face index of safetensors shards",
}
FILE_NAMES = {
    "full": "full.ckpt",
    "zip": "raw_zip.pth",
    "legacy": "raw_legacy.pth",
    "legacy-fabric": "fabric_legacy.ckpt",
    "safetensors": "model.safetensors",
    "hf-index": "hf-index/model.safetensors.index.json",
}
#: Shards of the Hugging Face index: about equal in bytes, whole tensors each, as `save_pretrained` splits them.
_HF_SHARDS = 4
#: Formats that lightning-fsdp runs with k=1 and k=all by default. With ``weights_only=True`` it reads them by byte
#: ranges, so k should not matter; with ``weights_only=False`` it reads a pickled file whole, in turns of k ranks.
_TURN_FORMATS = ("legacy", "legacy-fabric")
#: Formats that are also loaded as a trusted file, with ``weights_only=False``: read whole, the path that turns serve.
_TRUSTED_FORMATS = ("legacy-fabric",)
ADAM_STEP = 10.0
ADAM_LR = 1e-3
_CHECKSUM_PERIOD = 1013


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc_in = nn.Linear(width, 4 * width, bias=False)
        self.fc_out = nn.Linear(4 * width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc_out(torch.nn.functional.gelu(self.fc_in(self.norm(x))))


class Model(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def _checksum(tensor: torch.Tensor) -> tuple[float, float, float]:
    """Sum, position-weighted sum and weighted absolute sum, in float64 over the flattened tensor.

    The weighted sum changes when values move (a transposed or shifted shard), not only when they change.

    """
    flat = tensor.detach().reshape(-1).double()
    weights = torch.arange(flat.numel(), dtype=torch.float64, device=flat.device).remainder_(_CHECKSUM_PERIOD).add_(1)
    weighted = flat * weights
    return flat.sum().item(), weighted.sum().item(), weighted.abs_().sum().item()


def _state_dict_layout(width: int, depth: int) -> tuple[dict[str, tuple[int, ...]], list[str]]:
    with torch.device("meta"):
        model = Model(width, depth)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    return shapes, [name for name, _ in model.named_parameters()]


def _make_state_dict(width: int, depth: int) -> dict[str, torch.Tensor]:
    """Deterministic values that differ from what ``reset_parameters()`` produces, so a load that did nothing fails."""
    shapes, _ = _state_dict_layout(width, depth)
    state_dict = {}
    for index, (name, shape) in enumerate(shapes.items()):
        values = torch.randn(shape, generator=torch.Generator().manual_seed(1234 + index))
        if name.endswith("norm.weight"):
            values = values.mul_(0.1).add_(1.0)
        else:
            values = values.mul_(0.1 if name.endswith("norm.bias") else 0.02)
        state_dict[name] = values
    return state_dict


def _full_checkpoint(state_dict: dict[str, torch.Tensor], param_names: list[str]) -> dict[str, Any]:
    """The full checkpoint that ``fabric.save(path, {"model": model, "optimizer": adam})`` writes for this model.

    The Adam state is a known function of the parameters (``exp_avg = 0.5 * p``, ``exp_avg_sq = p * p``), so each rank
    can check its own optimizer shard exactly, without gathering anything.

    """
    group = torch.optim.Adam([nn.Parameter(torch.zeros(1))], lr=ADAM_LR).state_dict()["param_groups"][0]
    group["params"] = list(param_names)
    state = {
        name: {
            "step": torch.tensor(ADAM_STEP),
            "exp_avg": state_dict[name] * 0.5,
            "exp_avg_sq": state_dict[name] * state_dict[name],
        }
        for name in param_names
    }
    return {"model": state_dict, "optimizer": {"state": state, "param_groups": [group]}}


def write_checkpoints(workdir: Path, width: int, depth: int, formats: list[str], rewrite: bool) -> dict[str, Any]:
    """Write the checkpoint files (once) and return their description with the expected checksums."""
    meta_path = workdir / "checkpoints.json"
    config = {"width": width, "depth": depth, "checksum_period": _CHECKSUM_PERIOD, "adam_step": ADAM_STEP}
    meta: dict[str, Any] = {}
    if meta_path.is_file() and not rewrite:
        meta = json.loads(meta_path.read_text())
        if meta.get("config") != config:
            meta = {}
    files = meta.get("files", {})
    missing = [f for f in formats if f not in files or not Path(files[f]["path"]).is_file()]
    if not missing and meta:
        return meta
    workdir.mkdir(parents=True, exist_ok=True)
    _log(f"writing checkpoints ({', '.join(missing)}) for width {width}, depth {depth} to {workdir}")
    state_dict = _make_state_dict(width, depth)
    _, param_names = _state_dict_layout(width, depth)
    if "checksums" not in meta or not meta:
        meta = {"config": config, "files": {}, "key_order": list(state_dict)}
        meta["checksums"] = {name: _checksum(t) for name, t in state_dict.items()}
        meta["num_parameters"] = sum(t.numel() for t in state_dict.values())
        meta["model_bytes"] = sum(t.numel() * t.element_size() for t in state_dict.values())
    for fmt in missing:
        path = workdir / FILE_NAMES[fmt]
        start = time.monotonic()
        if fmt == "zip":
            torch.save(state_dict, path)
        elif fmt == "legacy":
            torch.save(state_dict, path, _use_new_zipfile_serialization=False)
        elif fmt == "legacy-fabric":
            torch.save({"model": state_dict}, path, _use_new_zipfile_serialization=False)
        elif fmt == "safetensors":
            from safetensors.torch import save_file

            save_file(state_dict, str(path))
        elif fmt == "hf-index":
            parts = _write_hf_index(state_dict, path)
        elif fmt == "full":
            checkpoint = _full_checkpoint(state_dict, param_names)
            torch.save(checkpoint, path)
            del checkpoint
        os.sync()
        entry: dict[str, Any] = {"path": str(path.resolve()), "bytes": path.stat().st_size}
        if fmt == "hf-index":
            entry["parts"] = [str(part.resolve()) for part in parts]
            entry["bytes"] += sum(part.stat().st_size for part in parts)
        meta["files"][fmt] = entry
        _log(f"  {FILE_NAMES[fmt]}: {entry['bytes'] / 1e9:.3f} GB in {time.monotonic() - start:.1f} s")
    del state_dict
    gc.collect()
    meta_path.write_text(json.dumps(meta))
    return meta


def _write_hf_index(state_dict: dict[str, torch.Tensor], index_path: Path) -> list[Path]:
    """Safetensors shards and ``model.safetensors.index.json``, as ``transformers``' ``save_pretrained`` writes them.

    The tensors keep their order and are cut into :data:`_HF_SHARDS` runs of about equal bytes.

    """
    from safetensors.torch import save_file

    index_path.parent.mkdir(parents=True, exist_ok=True)
    for stale in index_path.parent.glob("model-*.safetensors"):
        stale.unlink()
    names = list(state_dict)
    total = sum(t.numel() * t.element_size() for t in state_dict.values())
    count = min(_HF_SHARDS, len(names))
    groups: list[list[str]] = [[] for _ in range(count)]
    done = 0
    for name in names:
        # the shard whose share of the bytes this tensor starts in
        groups[min(count - 1, done * count // total)].append(name)
        done += state_dict[name].numel() * state_dict[name].element_size()
    groups = [group for group in groups if group]
    weight_map, parts = {}, []
    for number, group in enumerate(groups, start=1):
        part = index_path.parent / f"model-{number:05d}-of-{len(groups):05d}.safetensors"
        save_file({name: state_dict[name] for name in group}, str(part), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, part.name))
        parts.append(part)
    index_path.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return parts
