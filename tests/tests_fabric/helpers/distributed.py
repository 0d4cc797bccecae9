"""Run a function on several real processes that form a real ``torch.distributed`` process group."""

import multiprocessing
import os
import time
import traceback
from collections.abc import Callable
from typing import Any

from lightning.fabric.plugins.environments.lightning import find_free_network_port

_GRACE_AFTER_FAILURE = 10.0
_PRELOAD = ["torch", "torch.distributed.fsdp", "lightning.fabric", "lightning_fsdp", "tests.tests_fabric.helpers.state"]


def run_distributed(
    fn: Callable[..., Any],
    *args: Any,
    devices: int,
    num_nodes: int = 1,
    timeout: float = 240.0,
    start_method: str = "forkserver",
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` on ``num_nodes * devices`` processes and return what each returned, by global rank.

    Every process gets the variables that a user's launcher would set (``LOCAL_RANK``, ``NODE_RANK``,
    ``MASTER_ADDR``, ``MASTER_PORT``), so ``Fabric(devices=devices, num_nodes=num_nodes)`` inside ``fn`` joins the
    group without launching anything itself. An exception in any process fails the call with that process's
    traceback; a process still running after ``timeout`` seconds is killed and the call fails (no hung test).
    Ranks start from a fork server that has torch and Lightning imported (fast, and safe after the test process ran
    torch ops); CUDA tests pass ``start_method="spawn"``. ``fn`` and ``args`` must be picklable.

    """
    context = multiprocessing.get_context(start_method)
    if start_method == "forkserver":
        # The server imports these once; every rank forks from it with them loaded, so starting a rank is fast. It
        # never runs a torch op, so it has no OpenMP threads that a fork would leave dead (pytest's process may have:
        # a rank forked straight from it can hang in its first parallel op).
        context.set_forkserver_preload(_PRELOAD)
    results = context.SimpleQueue()
    port = find_free_network_port()
    world_size = devices * num_nodes
    processes = []
    for global_rank in range(world_size):
        rank_env = {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "NODE_RANK": str(global_rank // devices),
            "LOCAL_RANK": str(global_rank % devices),
            **(env or {}),
        }
        process = context.Process(target=_entry, args=(fn, args, rank_env, global_rank, results), daemon=True)
        process.start()
        processes.append(process)

    outcomes: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    first_failure_at: float | None = None
    while len(outcomes) < world_size and time.monotonic() < deadline:
        while not results.empty():
            rank, ok, value = results.get()
            outcomes[rank] = (ok, value)
        failed = any(not ok for ok, _ in outcomes.values()) or any(p.exitcode not in (None, 0) for p in processes)
        if failed and first_failure_at is None:
            first_failure_at = time.monotonic()
        # Once a rank failed, the others may wait forever in a collective: give them a grace period, not the timeout.
        if first_failure_at is not None and time.monotonic() - first_failure_at > _GRACE_AFTER_FAILURE:
            break
        time.sleep(0.02)

    for process in processes:
        process.join(timeout=10.0 if len(outcomes) == world_size else 0.5)
        if process.is_alive():
            process.kill()
            process.join()

    failures = [f"rank {rank}:\n{value}" for rank, (ok, value) in sorted(outcomes.items()) if not ok]
    missing = [rank for rank in range(world_size) if rank not in outcomes]
    if failures or missing:
        details = "\n".join(failures)
        if missing:
            codes = {rank: processes[rank].exitcode for rank in missing}
            details += f"\nno result from ranks {missing} (exit codes {codes}; timeout {timeout}s)"
        raise AssertionError(f"Distributed run failed:\n{details}")
    return [outcomes[rank][1] for rank in range(world_size)]


def _entry(fn: Callable[..., Any], args: tuple, env: dict[str, str], global_rank: int, results: Any) -> None:
    os.environ.update(env)
    try:
        value = fn(*args)
    except BaseException:
        results.put((global_rank, False, traceback.format_exc()))
        raise SystemExit(1) from None
    results.put((global_rank, True, value))
