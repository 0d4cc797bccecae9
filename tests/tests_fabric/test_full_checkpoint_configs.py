"""Full checkpoints with optimizer state load shard-locally and bit-exact in every FSDP configuration.

For each configuration a model trains two steps, is saved as a full Fabric checkpoint, and trains on; a fresh model
loads the checkpoint, must match the saved model and optimizer bit for bit, and must then train with exactly the
losses of the uninterrupted run. The shard-local path must serve every configuration (no fallback).
"""

import pytest
import torch
from lightning.fabric import Fabric
from torch.distributed.fsdp.wrap import wrap

from lightning_fsdp import FSDPStrategy
from lightning_fsdp.loading import loader
from tests.tests_fabric.helpers.distributed import run_distributed
from tests.tests_fabric.helpers.models import Block, TinyTransformer, make_batch
from tests.tests_fabric.helpers.runif import RunIf
from tests.tests_fabric.helpers.state import assert_same_state, gather_full_state

_OPTIMIZERS = {
    "adam": lambda params: torch.optim.Adam(params, lr=1e-2),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-1, momentum=0.9),
}

# name -> (strategy kwargs, fabric kwargs, model options)
_CONFIGS = {
    "full_shard": ({}, {}, {"optimizer": "adam"}),
    "full_shard-flat_params": ({"use_orig_params": False}, {}, {"optimizer": "adamw"}),
    "shard_grad_op": ({"sharding_strategy": "SHARD_GRAD_OP"}, {}, {"optimizer": "sgd"}),
    "no_shard": ({"sharding_strategy": "NO_SHARD", "use_orig_params": False}, {}, {"optimizer": "adam"}),
    "hybrid_shard": ({"sharding_strategy": "HYBRID_SHARD"}, {}, {"optimizer": "adam", "hybrid": True}),
    "cpu_offload": ({"cpu_offload": True}, {}, {"optimizer": "adam"}),
    "mixed_precision": ({}, {"precision": "bf16-mixed"}, {"optimizer": "adamw"}),
    "manual_wrap": ({"auto_wrap_policy": None}, {}, {"optimizer": "sgd", "manual_wrap": True}),
    "tied_weights": ({}, {}, {"optimizer": "adam", "tie_weights": True}),
    "tied_weights-flat_params": ({"use_orig_params": False}, {}, {"optimizer": "adam", "tie_weights": True}),
}


def _make(fabric: Fabric, options: dict, seed: int):
    fabric.seed_everything(seed)
    tie_weights = options.get("tie_weights", False)
    # Meta-device init unties weights; with manual wrapping nothing would materialize the parameters outside units.
    with fabric.init_module(empty_init=not tie_weights and not options.get("manual_wrap")):
        model = TinyTransformer(tie_weights=tie_weights)
        if options.get("manual_wrap"):
            model.blocks = torch.nn.ModuleList(wrap(block) for block in model.blocks)
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(_OPTIMIZERS[options["optimizer"]](model.parameters()))
    return model, optimizer


def _train(fabric: Fabric, model, optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        inputs, targets = make_batch(step)
        logits = model(inputs.to(fabric.device))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.to(fabric.device).flatten())
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _run_configs(
    devices: int, num_nodes: int, checkpoint_dir: str, names: list[str], accelerator: str = "cpu"
) -> list[str]:
    done = []
    for name in names:
        strategy_kwargs, fabric_kwargs, options = _CONFIGS[name]
        strategy_kwargs = {"auto_wrap_policy": {Block}, "state_dict_type": "full", **strategy_kwargs}
        if options.get("hybrid"):
            strategy_kwargs["device_mesh"] = (num_nodes, devices) if num_nodes > 1 else (2, devices // 2)
        strategy = FSDPStrategy(**strategy_kwargs)
        fabric = Fabric(
            accelerator=accelerator, devices=devices, num_nodes=num_nodes, strategy=strategy, **fabric_kwargs
        )
        fabric.launch()

        model, optimizer = _make(fabric, options, seed=1)
        _train(fabric, model, optimizer, range(2))
        saved = gather_full_state(model, optimizer)
        path = f"{checkpoint_dir}/{name}.ckpt"
        fabric.save(path, {"model": model, "optimizer": optimizer, "step": 2})
        expected_losses = _train(fabric, model, optimizer, range(2, 4))

        fresh_model, fresh_optimizer = _make(fabric, options, seed=2)
        state = {"model": fresh_model, "optimizer": fresh_optimizer, "step": 0}
        assert fabric.load(path, state) == {}
        assert state["step"] == 2
        try:
            assert_same_state(gather_full_state(fresh_model, fresh_optimizer), saved)
        except AssertionError as error:
            raise AssertionError(f"{name}: {error}") from None
        resumed_losses = _train(fabric, fresh_model, fresh_optimizer, range(2, 4))
        assert resumed_losses == expected_losses, f"{name}: {resumed_losses} != {expected_losses}"
        assert not loader._warned_fallbacks, f"{name}: fell back: {loader._warned_fallbacks}"
        done.append(name)
    return done


def _names_for(world_size: int, accelerator: str = "cpu") -> list[str]:
    names = list(_CONFIGS)
    if world_size < 4:  # hybrid sharding needs at least two replicas of at least two shards
        names.remove("hybrid_shard")
    if accelerator == "cpu":  # offloading needs an accelerator to offload from (FSDP pins host memory)
        names.remove("cpu_offload")
    return names


# Every configuration on one and on two ranks; four ranks as two nodes of two for what differs there (sharding within
# a node, hybrid sharding across the nodes). Four ranks on one node added no case of its own and ~35 s to the suite.
@pytest.mark.parametrize(("devices", "num_nodes"), [(1, 1), (2, 1), (2, 2)], ids=["1", "2", "2x2nodes"])
def test_full_checkpoint_loads_bit_exact_and_resumes(tmp_path, devices, num_nodes):
    names = _names_for(devices * num_nodes)
    if num_nodes > 1:
        names = ["full_shard", "full_shard-flat_params", "hybrid_shard", "tied_weights"]
    results = run_distributed(
        _run_configs, devices, num_nodes, str(tmp_path), names, devices=devices, num_nodes=num_nodes, timeout=600
    )
    assert results == [names] * (devices * num_nodes)


@RunIf(min_cuda_gpus=2, standalone=True)
def test_full_checkpoint_loads_bit_exact_and_resumes_cuda(tmp_path):
    names = _names_for(2, accelerator="cuda")
    results = run_distributed(
        _run_configs, 2, 1, str(tmp_path), names, "cuda", devices=2, start_method="spawn", timeout=600
    )
    assert results == [names] * 2


def _load_while_unsharded(path: str, expected_path: str) -> str:
    import warnings

    strategy = FSDPStrategy(auto_wrap_policy={Block}, sharding_strategy="SHARD_GRAD_OP")
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = TinyTransformer()
    model = fabric.setup_module(model)
    with torch.no_grad():
        model(make_batch(0)[0])  # SHARD_GRAD_OP keeps the units unsharded after a forward without backward
    loader._warned_fallbacks.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fabric.load(path, {"model": model})
    assert_same_state(gather_full_state(model)["model"], torch.load(expected_path, weights_only=True))
    return " ".join(str(warning.message) for warning in caught)


def test_falls_back_to_fsdp_state_dict_loading_with_one_warning(tmp_path):
    """Where the shard-local path cannot serve (here: units unsharded after an eval forward), FSDP's own serves."""
    torch.manual_seed(0)
    state_dict = TinyTransformer().state_dict()
    torch.save(state_dict, tmp_path / "model.pth")
    messages = run_distributed(
        _load_while_unsharded, str(tmp_path / "model.pth"), str(tmp_path / "model.pth"), devices=2
    )
    assert "The checkpoint cannot be loaded shard-locally" in messages[0]
    assert "holds an unsharded copy of its parameters" in messages[0]
    assert "shard-locally" not in messages[1]  # the warning is rank 0's only
