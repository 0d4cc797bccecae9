"""A load prints nothing the user did not ask for: torch's warnings about its own deprecated internals are silenced
inside our calls (by category and message), and the same warnings from the user's own code still show."""

import warnings

import torch
from lightning.fabric import Fabric

from lightning_fsdp import FSDPStrategy
from lightning_fsdp.loading.quiet import torch_internal_warnings_silenced
from tests.tests_fabric.helpers.distributed import run_distributed
from tests.tests_fabric.helpers.models import Block, TinyTransformer, make_batch

_TORCH_INTERNALS = (
    "ShardedTensor",
    "state_dict_type",
    "_get_pg_default_device",
    "Multiple backends",
    "`load_state_dict` is deprecated",
)


def _load_sharded_and_record(path: str) -> list[str]:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy(auto_wrap_policy={Block}))
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = TinyTransformer()
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters()))
    tokens, targets = make_batch(0)
    fabric.backward(torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()))
    optimizer.step()  # an optimizer that never stepped saves no state, which its own loader refuses (upstream)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # the test suite's own filters must not hide anything here
        fabric.save(path, {"model": model, "optimizer": optimizer, "step": 1})
        fabric.load(path, {"model": model, "optimizer": optimizer, "step": 0})
    return [str(warning.message) for warning in caught]


def test_sharded_save_and_load_emit_no_torch_internal_warnings(tmp_path):
    for messages in run_distributed(_load_sharded_and_record, str(tmp_path / "sharded"), devices=2, timeout=120):
        noisy = [m for m in messages if any(text in m for text in _TORCH_INTERNALS)]
        assert not noisy, noisy


def test_the_same_warnings_from_user_code_still_show():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch_internal_warnings_silenced():
            warnings.warn(
                "Please use DTensor instead and we are deprecating ShardedTensor.", FutureWarning, stacklevel=1
            )
        warnings.warn("Please use DTensor instead and we are deprecating ShardedTensor.", FutureWarning, stacklevel=1)
        with torch_internal_warnings_silenced():
            warnings.warn("something else", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == [
        "Please use DTensor instead and we are deprecating ShardedTensor.",
        "something else",
    ]
