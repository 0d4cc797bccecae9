"""Checkpoints in object storage: a real S3 API (moto's server on 127.0.0.1, s3fs as the client), 2 CPU ranks.

Every format loads from ``s3://`` bit-exact as the same file loads from disk, with both strategies, a sharded
directory (model and optimizer) too; each rank fetches only part of the object (of a sharded directory, its own
entries); faults of the store (missing object or bucket, denied access, server errors, throttling, a
connection reset in a range, an object replaced during the load, a truncated object) end in one clear error on every
rank, with the model untouched where the error comes before the copy, and no credential in any message.
"""

import contextlib
import io
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_fsdp import CheckpointLoadError, FSDPStrategy, ModelParallelStrategy
from lightning_fsdp.loading import progress as progress_module
from lightning_fsdp.loading import remote, remote_requests
from lightning_fsdp.loading.files import fetched_bytes
from lightning_fsdp.loading.progress import PROGRESS_ENV_VAR
from lightning_fsdp.loading.sources import materialize
from tests.tests_fabric.helpers.checkpoints import FORMATS, MarkerPayload, write_checkpoint
from tests.tests_fabric.helpers.distributed import run_distributed
from tests.tests_fabric.helpers.hostile_dcp import (
    copy_checkpoint,
    read_metadata,
    truncate_shard,
    write_metadata,
)
from tests.tests_fabric.helpers.models import Block, TinyTransformer, make_batch
from tests.tests_fabric.helpers.object_store import (
    BUCKET,
    KEY,
    SECRET,
    ObjectStore,
    object_store,  # noqa: F401 (the fixture)
    proxy_stats,
    set_faults,
    without_client_retries,
)
from tests.tests_fabric.helpers.state import assert_same_state, gather_full_state

_WIDTH = 128  # tensors of 64 KiB and more: larger than the blocks small reads are served from


def _parallelize(model: nn.Module, device_mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=device_mesh["data_parallel"])
    return fully_shard(model, mesh=device_mesh["data_parallel"])


def _fabric(strategy: str) -> Fabric:
    if strategy == "fsdp1":
        chosen: Any = FSDPStrategy(auto_wrap_policy={Block}, state_dict_type="full")
    else:
        chosen = ModelParallelStrategy(
            _parallelize, data_parallel_size=2, tensor_parallel_size=1, save_distributed_checkpoint=False
        )
    fabric = Fabric(accelerator="cpu", devices=2, strategy=chosen)
    fabric.launch()
    return fabric


def _fresh(fabric: Fabric, seed: int) -> tuple[nn.Module, Any]:
    fabric.seed_everything(seed)
    model = fabric.setup_module(TinyTransformer(width=_WIDTH))
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-2))
    return model, optimizer


def _full_state(strategy: str, model: nn.Module, optimizer: Any) -> dict:
    if strategy == "fsdp1":
        return gather_full_state(model, optimizer)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    module, options = getattr(model, "_forward_module", model), StateDictOptions(full_state_dict=True)
    optimizer = getattr(optimizer, "optimizer", optimizer)
    return materialize(
        {
            "model": get_model_state_dict(module, options=options),
            "optimizer": get_optimizer_state_dict(module, optimizer, options=options),
        }
    )


def _load_local_and_remote(strategy: str, raw: dict[str, tuple[str, str]], full_dir: str, options: dict) -> dict:
    """Load each checkpoint from disk and from S3 into fresh models; the two must be identical, bit for bit."""
    progress_module._SHOW_AFTER_S = 0.0  # the node's bar, drawn from the start, shows the bytes fetched
    os.environ[PROGRESS_ENV_VAR] = "1"
    fabric = _fabric(strategy)
    fetched: dict[str, Any] = {}
    with fabric.strategy.load_options(storage_options=options):
        for fmt, (local, url) in raw.items():
            states = []
            for path in (local, url):
                model, optimizer = _fresh(fabric, seed=7)
                before = fetched_bytes()
                with contextlib.redirect_stderr(io.StringIO()) as bar:
                    fabric.load_raw(path, model)
                if path == url:
                    fetched[fmt] = fetched_bytes() - before
                    fetched[f"{fmt} bar"] = bar.getvalue()
                states.append(_full_state(strategy, model, optimizer)["model"])
            assert_same_state(states[1], states[0], fmt)

        # A full Fabric checkpoint with Adam's state, written by this strategy and uploaded by rank 0.
        model, optimizer = _fresh(fabric, seed=1)
        inputs, _ = make_batch(0)
        fabric.backward(model(inputs).sum())
        optimizer.step()
        local = Path(full_dir) / f"{strategy}.ckpt"
        fabric.save(local, {"model": model, "optimizer": optimizer, "step": 3})
        url = f"s3://{BUCKET}/full/{strategy}.ckpt"
        if fabric.global_rank == 0:
            import fsspec

            fsspec.filesystem("s3", **options).put(str(local), url)
        fabric.barrier()
        states = []
        for path in (local, url):
            model, optimizer = _fresh(fabric, seed=2)
            state = {"model": model, "optimizer": optimizer, "step": 0}
            assert fabric.load(path, state) == {}
            assert state["step"] == 3
            states.append(_full_state(strategy, model, optimizer))
        assert_same_state(states[1], states[0], "full checkpoint")
    return fetched


@pytest.mark.parametrize("strategy", ["fsdp1", "fsdp2"])
def test_every_format_loads_from_s3_as_from_disk(object_store: ObjectStore, tmp_path, strategy):  # noqa: F811
    torch.manual_seed(0)
    state = TinyTransformer(width=_WIDTH).state_dict()
    raw = {}
    for fmt in FORMATS:
        path = write_checkpoint(state, tmp_path / fmt, fmt)
        url = object_store.upload(tmp_path / fmt, f"{strategy}/{fmt}")
        raw[fmt] = (str(path), url if path == tmp_path / fmt else f"{url}/{path.name}")
    (tmp_path / "full").mkdir()
    fetched = run_distributed(
        _load_local_and_remote, strategy, raw, str(tmp_path / "full"), object_store.storage_options(), devices=2
    )
    # Each rank fetched its own part of the object (and the header), not the object: together about one copy.
    size = (tmp_path / "safetensors" / "model.safetensors").stat().st_size
    per_rank = [rank["safetensors"] for rank in fetched]
    assert all(count < 0.75 * size for count in per_rank), (per_rank, size)
    assert sum(per_rank) < 1.25 * size, (per_rank, size)
    # Local rank 0 draws the node's bar, which shows what the node fetched.
    assert "fetched " in fetched[0]["safetensors bar"].rsplit("\r", 1)[-1]
    assert fetched[1]["safetensors bar"] == ""


_CASES = {
    "missing object": ([], "missing.pt", "does not exist"),
    "missing bucket": ([], "s3://no-such-bucket/model.pt", "does not exist"),
    "access denied": (
        [
            {"kind": "status", "status": 403, "code": "AccessDenied", "count": -1, "method": method, "ranged": False}
            for method in ("HEAD", "GET")
        ],
        "model.pt",
        "access was denied",
    ),
    "server errors": (
        [{"kind": "status", "status": 500, "code": "InternalError", "count": -1}],
        "model.pt",
        "could not be read after 5 attempts",
    ),
    "throttled, then served": ([{"kind": "status", "status": 503, "code": "SlowDown", "count": 3}], "model.pt", None),
    "reset mid-range, then served": ([{"kind": "reset", "count": 2}], "model.pt", None),
    "a tensor's range reset mid-body, then served": (
        [{"kind": "reset", "count": 2, "min_range_bytes": remote.BLOCK_BYTES + 1}],
        "model.pt",
        None,
    ),
    "a tensor's range answered with the whole object": (
        [{"kind": "unranged", "count": -1, "min_range_bytes": remote.BLOCK_BYTES + 1}],
        "model.pt",
        "could not be read after 5 attempts at the range",
    ),
    "truncated object": (
        [],
        "truncated.pt",
        "bytes, but its records say it had at least",  # the size its pickle needs: read from the store as on disk
    ),
    "replaced during the load": (
        [{"kind": "replace", "key": "faults/model.pt", "flip_at": 0.5, "count": 1}],
        "model.pt",
        "was changed while it was being loaded",
    ),
}


def _faults(proxy: str, options: dict, expected_path: str) -> dict[str, str]:
    remote_requests.FIRST_BACKOFF_S = 0.02  # the schedule's shape is what is tested, not its duration
    without_client_retries()
    fabric = _fabric("fsdp1")
    expected = torch.load(expected_path, weights_only=True)
    outcomes = {}
    with fabric.strategy.load_options(storage_options=options):
        for case, (rules, name, _) in _CASES.items():
            if fabric.global_rank == 0:
                set_faults(proxy, rules)
            fabric.barrier()
            model, _ = _fresh(fabric, seed=3)
            before = gather_full_state(model)["model"]
            url = name if name.startswith("s3://") else f"s3://{BUCKET}/faults/{name}"
            try:
                fabric.load_raw(url, model)
            except CheckpointLoadError as error:
                outcomes[case] = str(error)
                if "partially loaded" not in str(error):
                    assert_same_state(gather_full_state(model)["model"], before, case)
            else:
                outcomes[case] = "loaded"
                assert_same_state(gather_full_state(model)["model"], expected, case)
            fabric.barrier()
            if fabric.global_rank == 0:
                outcomes[f"{case} fired"] = proxy_stats(proxy)["fired"]  # the faults the proxy made in this case
    if fabric.global_rank == 0:
        set_faults(proxy, [])
    return outcomes


def test_store_faults_give_one_clear_error_on_every_rank(object_store: ObjectStore, tmp_path):  # noqa: F811
    torch.manual_seed(0)
    state = TinyTransformer(width=_WIDTH).state_dict()
    local = tmp_path / "model.pt"
    torch.save(state, local)
    object_store.upload(local, "faults")
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(local.read_bytes()[: local.stat().st_size * 2 // 3])
    object_store.upload(truncated, "faults")
    shutil.copy(local, tmp_path / "expected.pt")

    outcomes = run_distributed(
        _faults, object_store.proxy, object_store.storage_options(), str(tmp_path / "expected.pt"), devices=2
    )
    for case, (rules, _, pattern) in _CASES.items():
        assert not rules or outcomes[0][f"{case} fired"] > 0, f"{case}: the proxy made none of its faults"
        messages = [rank[case] for rank in outcomes]
        for message in messages:
            if pattern is None:
                assert message == "loaded", f"{case}: {message}"
            else:
                assert pattern in message, f"{case}: {message}"
            assert KEY not in message, f"{case}: {message}"
            assert SECRET not in message, f"{case}: {message}"
        assert messages[0] == messages[1], f"{case}: the ranks disagree: {messages}"


_TENSOR_RANGE = (
    remote.BLOCK_BYTES + 1
)  # the faults below hit the tensors' ranges, not the small reads of the structures
#: The timeouts of the stalled cases: short, so that the test takes seconds; the bound is what is tested.
_REQUEST_TIMEOUT_S, _STALL_TIMEOUT_S = 4.0, 8.0
#: How long a stalled store holds a request before it gives up by itself (the load must end long before).
_STALL_S = 60

_LYING_CASES = {
    "a tensor's range redirected to another server's zeros": (
        [{"kind": "redirect", "total": 1048576, "etag": "0" * 32, "count": -1, "min_range_bytes": _TENSOR_RANGE}],
        "with bytes of another object: its Content-Range",
    ),
    "a tensor's range redirected to an object of the same size with another ETag": (
        [{"kind": "redirect", "total": None, "etag": "f" * 32, "count": -1, "min_range_bytes": _TENSOR_RANGE}],
        "with bytes of another object: its ETag is 'ffffffffffffffffffffffffffffffff'",
    ),
    "every read redirected to a mirror of the same object": ([{"kind": "redirect", "mirror": True, "count": -1}], None),
    "the store stops answering a tensor's range": (
        [{"kind": "stall", "seconds": _STALL_S, "count": -1, "min_range_bytes": _TENSOR_RANGE}],
        "stopped answering: no byte of the range",
    ),
    "the store stops answering one range of one rank, the other rank waiting": (
        [{"kind": "stall", "seconds": _STALL_S, "count": -1, "min_range_bytes": _TENSOR_RANGE, "same_range": True}],
        "stopped answering: no byte of the range",
    ),
    "one rank refused at once, the other rank's range stops answering": (  # the ranks fail 5 s apart
        [
            {
                "kind": "redirect",
                "total": 1048576,
                "etag": "0" * 32,
                "count": -1,
                "min_range_bytes": _TENSOR_RANGE,
                "same_range": True,
            },
            {"kind": "stall", "seconds": _STALL_S, "count": -1, "min_range_bytes": _TENSOR_RANGE, "same_range": True},
        ],
        "failed on ranks 0-1",
    ),
    "the store stops answering the first request": (
        [{"kind": "stall", "seconds": _STALL_S, "count": -1, "method": "HEAD", "ranged": False}],
        f"did not answer within {_REQUEST_TIMEOUT_S:g} s",
    ),
    "a tensor's range cut short on every attempt": (
        [{"kind": "reset", "count": -1, "min_range_bytes": _TENSOR_RANGE, "skip": 1}],
        "partially loaded",
    ),
    "a tensor's range shifted on every attempt": (
        [{"kind": "shifted", "count": -1, "min_range_bytes": _TENSOR_RANGE, "skip": 1}],
        "partially loaded",
    ),
    "a tensor's range one byte short on every attempt": (
        [{"kind": "short", "count": -1, "min_range_bytes": _TENSOR_RANGE, "skip": 1}],
        "partially loaded",
    ),
}
#: What the stalled cases' errors say: the object, the range, the tensor, and how long nothing arrived.
_STALLED = re.compile(
    r"The object 's3://checkpoints/lying/model\.pt' stopped answering: no byte of the range \d+-\d+ \(the tensor"
    rf" '[\w.]+'\) arrived for \d+ s, after \d attempt\(s\) \(the last: no byte within {_REQUEST_TIMEOUT_S:g} s\)"
)
#: And the errors of a range that keeps failing: the object, the range and the tensor, then the last failure.
_GAVE_UP = re.compile(
    r"The object 's3://checkpoints/lying/model\.pt' could not be read after 5 attempts at the range \d+-\d+ \(the"
    r" tensor '[\w.]+'\): \w+"
)


def _lying_store(proxy: str, options: dict, expected_path: str, size: int) -> dict[str, Any]:
    remote_requests.FIRST_BACKOFF_S = 0.02
    without_client_retries()
    fabric = _fabric("fsdp1")
    expected = torch.load(expected_path, weights_only=True)
    url = f"s3://{BUCKET}/lying/model.pt"
    outcomes: dict[str, Any] = {}
    timeouts = {"request_timeout": _REQUEST_TIMEOUT_S, "stall_timeout": _STALL_TIMEOUT_S}
    with fabric.strategy.load_options(storage_options=options):
        # A first load with the default timeouts: the client's first use in a process (its imports, its first
        # connection) can take more than the cases' 2 s on a busy machine, and would end the first case too soon.
        fabric.load_raw(url, _fresh(fabric, seed=3)[0])
    with fabric.strategy.load_options(storage_options=options, **timeouts):
        for case, (rules, _) in _LYING_CASES.items():
            if fabric.global_rank == 0:
                set_faults(proxy, [{**rule, "total": rule.get("total") or size} for rule in rules])
            fabric.barrier()
            model, _ = _fresh(fabric, seed=3)
            before = gather_full_state(model)["model"]
            started = time.monotonic()
            try:
                fabric.load_raw(url, model)
            except CheckpointLoadError as error:
                outcomes[f"{case} took"] = time.monotonic() - started
                outcomes[f"{case} raised at"] = time.time()
                outcomes[case] = str(error)
                after = gather_full_state(model)["model"]
                if "partially loaded" not in str(error):
                    assert_same_state(after, before, case)
                else:  # what the guide says then: some tensors were written, the model is not the checkpoint's
                    outcomes[f"{case} written"] = not _same(after, before) and not _same(after, expected)
            else:
                outcomes[f"{case} took"] = time.monotonic() - started
                outcomes[case] = "loaded"
                assert_same_state(gather_full_state(model)["model"], expected, case)
            fabric.barrier()
            if fabric.global_rank == 0:
                stats = proxy_stats(proxy)
                outcomes[f"{case} fired"], outcomes[f"{case} first fault at"] = stats["fired"], stats["first_fired_at"]
                set_faults(proxy, [])
            fabric.barrier()
            if outcomes[case] != "loaded":
                # What a user does next: the same load (with the default timeouts), once the store serves the object.
                with fabric.strategy.load_options(storage_options=options):
                    fabric.load_raw(url, model)
                assert_same_state(gather_full_state(model)["model"], expected, f"{case}, loaded again")
    return outcomes


def _same(state: dict, other: dict) -> bool:
    try:
        assert_same_state(state, other, "")
    except AssertionError:
        return False
    return True


def test_a_lying_or_stalled_store_is_refused_within_a_bound(object_store: ObjectStore, tmp_path):  # noqa: F811
    """A redirect to another server's bytes is refused (a mirror of the same object is not), a store that stops
    answering ends the load within the stall timeout, and each case ends with the same error on every rank."""
    torch.manual_seed(0)
    local = tmp_path / "model.pt"
    torch.save(TinyTransformer(width=_WIDTH).state_dict(), local)
    object_store.upload(local, "lying")
    outcomes = run_distributed(
        _lying_store, object_store.proxy, object_store.storage_options(), str(local), local.stat().st_size, devices=2
    )
    for case, (_, pattern) in _LYING_CASES.items():
        messages = [rank[case] for rank in outcomes]
        assert outcomes[0][f"{case} fired"] > 0, f"{case}: the proxy made none of its faults: {messages}"
        assert messages[0] == messages[1], f"{case}: the ranks disagree: {messages}"
        if pattern is None:
            assert messages[0] == "loaded", f"{case}: {messages[0]}"
        else:
            assert pattern in messages[0], f"{case}: {messages[0]}"
            assert "s3://checkpoints/lying/model.pt" in messages[0], f"{case}: {messages[0]}"
        if "partially loaded" in messages[0]:
            assert messages[0].endswith("load the checkpoint again before using the model."), messages[0]
        if "on every attempt" in case:  # the first tensor's range was served: the failure came after a write
            assert outcomes[0][f"{case} written"], f"{case}: nothing was written, or everything"
            assert _GAVE_UP.search(messages[0]), f"{case}: {messages[0]}"
        if "stops answering" in case and "first request" not in case:
            assert _STALLED.search(messages[0]), f"{case}: {messages[0]}"
        if "stops answering" in case:
            # The bound, from the first request that got no answer to the last rank's error: the stall timeout (the
            # request timeout for the first request), and the agreement's polling.
            took = max(rank[f"{case} raised at"] for rank in outcomes) - outcomes[0][f"{case} first fault at"]
            bound = _REQUEST_TIMEOUT_S if "first request" in case else _STALL_TIMEOUT_S
            assert bound / 2 < took < bound + 5.0, f"{case}: {took:.1f} s"  # the proxy sees a request late under load
        if "first request" in case:  # each rank asked once: the error stands, the store is not asked again for it
            assert outcomes[0][f"{case} fired"] == 2, outcomes[0][f"{case} fired"]


def _sharded_fabric(strategy: str) -> Fabric:
    if strategy == "fsdp1":
        chosen: Any = FSDPStrategy(auto_wrap_policy={Block}, state_dict_type="sharded")
    else:
        chosen = ModelParallelStrategy(_parallelize, data_parallel_size=2, tensor_parallel_size=1)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=chosen)
    fabric.launch()
    return fabric


def _trained(fabric: Fabric, seed: int) -> tuple[nn.Module, Any]:
    """A fresh model and Adam after one step: the optimizer has state, and the model differs from the seed's."""
    model, optimizer = _fresh(fabric, seed)
    inputs, _ = make_batch(seed)
    fabric.backward(model(inputs).sum())
    optimizer.step()
    return model, optimizer


def _save_sharded(strategy: str, path: str) -> None:
    fabric = _sharded_fabric(strategy)
    model, optimizer = _trained(fabric, seed=1)
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 3})


def _payload_in_metadata(path: Path) -> None:
    metadata = read_metadata(path)
    metadata.version = MarkerPayload(Path(f"{path}.marker"))
    write_metadata(path, metadata)


#: name -> (tamper with a local copy before it is uploaded, fault rules of the proxy, the error expected on every rank)
_SHARDED_CASES = {
    "code in .metadata": (
        _payload_in_metadata,
        [],
        r"Refused to unpickle `io\.open` from the sharded checkpoint's metadata file 's3://.*/\.metadata' \(the"
        r" payload was not run\)",
    ),
    "truncated shard": (
        lambda path: truncate_shard(path, "__0_0.distcp"),
        [],
        r"The shard file 's3://.*/__0_0\.distcp' of the sharded checkpoint is truncated: the metadata places data up"
        r" to byte \d+, but the file has \d+ bytes",
    ),
    "missing shard object": (
        lambda path: (path / "__1_0.distcp").unlink(),
        [],
        r"The shard file of the sharded checkpoint 's3://.*/__1_0\.distcp' does not exist \(no such object",
    ),
    "shard replaced during the load": (
        lambda path: None,
        [{"kind": "replace", "key": "{prefix}/__0_0.distcp", "flip_at": 0.5, "count": 1}],
        r"The object 's3://.*/__0_0\.distcp' was changed while it was being loaded",
    ),
}


def _load_sharded_local_and_remote(strategy: str, local: str, urls: dict[str, str], proxy: str, options: dict) -> dict:
    """Load the sharded checkpoint from disk and from S3 (bit-exact alike, counting the bytes fetched), then each
    hostile copy from S3 (one error on every rank, the model and the optimizer untouched, no payload run)."""
    fabric = _sharded_fabric(strategy)
    outcomes: dict[str, Any] = {}
    with fabric.strategy.load_options(storage_options=options):
        states = []
        for path in (local, urls["intact"]):
            model, optimizer = _trained(fabric, seed=2)
            state = {"model": model, "optimizer": optimizer, "step": 0}
            if fabric.global_rank == 0:
                set_faults(proxy, [])  # zeroes the proxy's counters
            fabric.barrier()
            before = fetched_bytes()
            assert fabric.load(path, state) == {}
            fabric.barrier()
            if path == urls["intact"]:
                outcomes["fetched"] = fetched_bytes() - before
                outcomes["proxy GET bytes"] = proxy_stats(proxy)["get_bytes"]  # of both ranks
            assert state["step"] == 3
            states.append(gather_full_state(model, optimizer))
        assert_same_state(states[1], states[0], "sharded checkpoint")

        model, optimizer = _trained(fabric, seed=3)
        before = gather_full_state(model, optimizer)
        for case, (_, rules, _) in _SHARDED_CASES.items():
            if fabric.global_rank == 0:
                prefix = urls[case].split(f"{BUCKET}/", 1)[1]
                set_faults(proxy, [{**rule, "key": rule["key"].format(prefix=prefix)} for rule in rules])
            fabric.barrier()
            try:
                fabric.load(urls[case], {"model": model, "optimizer": optimizer})
            except CheckpointLoadError as error:
                outcomes[case] = str(error)
            else:
                outcomes[case] = "loaded"
            assert_same_state(gather_full_state(model, optimizer), before, case)
            fabric.barrier()
    if fabric.global_rank == 0:
        set_faults(proxy, [])
    return outcomes


@pytest.mark.parametrize("strategy", ["fsdp1", "fsdp2"])
def test_sharded_checkpoint_loads_from_s3_as_from_disk(object_store: ObjectStore, tmp_path, strategy):  # noqa: F811
    """A sharded checkpoint (model and Adam's state) that Fabric saved, loaded from S3: bit-exact as from disk, each
    rank fetching its own entries only; hostile and broken copies refused on every rank, the model untouched."""
    saved = tmp_path / "saved"
    run_distributed(_save_sharded, strategy, str(saved), devices=2)
    urls = {"intact": object_store.upload(saved, f"sharded-{strategy}/intact")}
    for index, (case, (tamper, _, _)) in enumerate(_SHARDED_CASES.items()):
        copy = copy_checkpoint(saved, tmp_path / f"case-{index}")
        tamper(copy)
        urls[case] = object_store.upload(copy, f"sharded-{strategy}/case-{index}")

    outcomes = run_distributed(
        _load_sharded_local_and_remote,
        strategy,
        str(saved),
        urls,
        object_store.proxy,
        object_store.storage_options(),
        devices=2,
    )
    # Each rank fetched the entries of its own shards (and the metadata), not the checkpoint: together about one copy.
    size = sum(file.stat().st_size for file in saved.iterdir())
    per_rank = [rank["fetched"] for rank in outcomes]
    assert all(count < 0.75 * size for count in per_rank), (per_rank, size)
    assert sum(per_rank) < 1.1 * size, (per_rank, size)
    assert outcomes[0]["proxy GET bytes"] < 1.1 * size, (outcomes[0]["proxy GET bytes"], size)
    for index, (case, (_, _, pattern)) in enumerate(_SHARDED_CASES.items()):
        messages = [rank[case] for rank in outcomes]
        assert messages[0] == messages[1], f"{case}: the ranks disagree: {messages}"
        assert re.search(pattern, messages[0], flags=re.DOTALL), f"{case}: {messages[0]!r} does not match {pattern!r}"
        assert KEY not in messages[0], f"{case}: {messages[0]}"
        assert SECRET not in messages[0], f"{case}: {messages[0]}"
        assert not (tmp_path / f"case-{index}.marker").exists(), f"{case}: the payload ran"
