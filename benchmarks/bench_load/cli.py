"""The command line: parse the options, write the checkpoints, run every case, print and save the report."""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from . import __doc__ as _DESCRIPTION
from .capacity import parse_bytes, run_capacity
from .checkpoints import (
    _TRUSTED_FORMATS,
    _TURN_FORMATS,
    FORMATS,
    FSDP2_FORMATS,
    PRESETS,
    STRATEGIES,
    STRATEGY_TITLES,
    write_checkpoints,
)
from .object_store import MASTER_REMOTE_FORMATS, REMOTE_IMPLEMENTATIONS, SERVERS, start_object_store
from .output import _gb, _log
from .report import _machine, render
from .runner import _BUSY_MACHINE, Case, run_case

#: The label of the core's rows: Lightning's strategies plus only the core's shard-local loading
#: (`lightning_fsdp.core.fsdp.FSDPStrategy`, `lightning_fsdp.core.model_parallel.ModelParallelStrategy`).
CORE_LABEL = "core"
_SAFETENSORS_FORMATS = ("safetensors", "hf-index")


def _size(text: str) -> tuple[int, int, str]:
    if text in PRESETS:
        return (*PRESETS[text], text)
    width, sep, depth = text.lower().partition("x")
    if not sep or not width.isdigit() or not depth.isdigit():
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(PRESETS)} or WIDTHxDEPTH, got {text!r}")
    return int(width), int(depth), f"{width}x{depth}"


def _cases(args: argparse.Namespace) -> list[Case]:
    """Every load to run: for each strategy family, format and implementation (and ``k`` for lightning-fsdp)."""
    return [case for strategy in args.strategies for case in _strategy_cases(args, strategy)]


def _strategy_cases(args: argparse.Namespace, strategy: str) -> list[Case]:
    import lightning

    import lightning_fsdp

    ours_class = lightning_fsdp.ModelParallelStrategy if strategy == "fsdp2" else lightning_fsdp.FSDPStrategy
    has_concurrency = "load_concurrency" in inspect.signature(ours_class.__init__).parameters
    try:
        import safetensors  # noqa: F401

        has_safetensors = True
    except ImportError:
        has_safetensors = False
    formats = [f for f in args.formats if strategy == "fsdp" or f in FSDP2_FORMATS]
    per_node = args.ranks // args.nodes
    cases = []
    for fmt, weights_only in [(f, w) for f in formats for w in (True, False) if w or f in _TRUSTED_FORMATS]:
        for impl in args.implementations:
            if impl in REMOTE_IMPLEMENTATIONS:
                label, reason = _remote_label(args, impl, fmt, weights_only)
                cases.append(Case(fmt, impl, None, label, reason, weights_only, strategy))
                continue
            if impl == "upstream":
                reason = _upstream_unavailable(fmt)
                label = f"upstream {lightning.__version__}"
                cases.append(Case(fmt, impl, None, label, reason, weights_only, strategy))
                continue
            if impl == "core":
                # Lightning's strategy with the core's shard-local loading: no `load_concurrency` (k=1 where it reads
                # a file whole), every local format
                reason = (
                    "n/a (safetensors is not installed)"
                    if fmt in _SAFETENSORS_FORMATS and not has_safetensors
                    else None
                )
                cases.append(Case(fmt, impl, None, CORE_LABEL, reason, weights_only, strategy))
                continue
            ks = args.load_concurrency
            if ks is None:
                ks = ["1", "all"] if fmt in _TURN_FORMATS else []
            variants: list[int | str | None] = [k if k in ("all", "auto") else int(k) for k in ks] or [None]
            if not has_concurrency and None not in variants:
                variants.append(None)
            for k in variants:
                label = "lightning-fsdp" + ("" if k is None else f", k={k}" + (f" ({per_node})" if k == "all" else ""))
                reason = None
                if k is not None and not has_concurrency:
                    reason = "n/a (`load_concurrency` not available yet)"
                if fmt in _SAFETENSORS_FORMATS and not has_safetensors:
                    reason = "n/a (safetensors is not installed)"
                cases.append(Case(fmt, impl, k, label, reason, weights_only, strategy))
    return cases


def _remote_label(args: argparse.Namespace, impl: str, fmt: str, weights_only: bool) -> tuple[str, str | None]:
    """The label of a remote row, and why it cannot run (``None`` if it can)."""
    server = "stock moto" if args.s3_server == "stock" else "moto, ranges served by seek"
    if impl == "s3":
        return f"lightning-fsdp, from s3:// ({server})", None
    if impl == "s3-client-in-base":
        return f"lightning-fsdp, from s3://, S3 client created before the base ({server})", None
    label = f"Lightning master, from s3:// ({server})"
    if fmt not in MASTER_REMOTE_FORMATS or not weights_only:
        return label, "n/a (Lightning master reads a remote file with `torch.load`: no safetensors, no index)"
    return label, args.master_problem


def _master_problem(source: Path | None) -> str | None:
    """Why Lightning's source tree at ``source`` cannot run the ``master-s3`` rows beside this environment, or ``None``.

    The rank processes put it first on ``PYTHONPATH``; it must import cleanly with the installed torch and fsspec.
    """
    if source is None:
        return "n/a (give the `src` folder of a Lightning checkout with `--lightning-master`)"
    check = "import lightning.fabric.strategies, lightning.fabric.utilities.cloud_io as c; print(c.__file__)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(source), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=300)
    found = Path(done.stdout.strip() or ".").resolve()
    if done.returncode != 0 or not found.is_relative_to(source.resolve()):
        error = (done.stderr.strip().splitlines() or [f"it imported {found} instead"])[-1]
        return f"n/a (Lightning at {source} does not import cleanly here: {error})"
    return None


def _upstream_unavailable(fmt: str) -> str | None:
    # Upstream's `load_raw` and `load` (FSDP1 and FSDP2 alike) read a file with `torch.load`, which reads neither
    # format: a safetensors file is not a pickle, and an index is a JSON file that names other files.
    if fmt == "safetensors":
        return "n/a (upstream has no safetensors support)"
    if fmt == "hf-index":
        return "n/a (upstream has no Hugging Face index support)"
    return None


def _cuda_problem(args: argparse.Namespace) -> str | None:
    """Why ``--device cuda`` cannot run here, or ``None``."""
    import torch

    count = torch.cuda.device_count()
    if count == 0:
        build = f"a CUDA {torch.version.cuda} build" if torch.version.cuda else "a CPU build, without CUDA"
        return (
            f"--device cuda: no GPU exists here (torch {torch.__version__} is {build}, and it sees no CUDA device)."
            " Run it on a machine with a GPU (`make test-gpu` installs a CUDA build of torch there), or leave out"
            " --device cuda to measure CPU ranks."
        )
    if args.capacity:
        return "--device cuda: the capacity mode caps host memory and runs on CPU ranks only; leave out --device cuda"
    if args.nodes > 1:
        return "--device cuda: simulated nodes would put two ranks on one GPU; use --nodes 1"
    if args.ranks > count:
        return f"--device cuda: --ranks {args.ranks} needs {args.ranks} GPUs, one per rank, and {count} are visible"
    return None


def _capacity_cases(args: argparse.Namespace) -> list[Case]:
    """The full checkpoint with Adam state, for each strategy family and implementation, with its default ``k``."""
    import lightning

    label = {"upstream": f"upstream {lightning.__version__}", "core": CORE_LABEL, "ours": "lightning-fsdp"}
    return [
        Case("full", impl, None, label[impl], strategy=strategy)
        for strategy in args.strategies
        for impl in args.implementations
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_load", description=_DESCRIPTION.splitlines()[0])
    parser.add_argument(
        "--size", type=_size, default="small", help=f"{', '.join(PRESETS)} or WIDTHxDEPTH (default: small)"
    )
    parser.add_argument("--ranks", type=int, default=4, help="total ranks (default: 4)")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the ranks run: CPU ranks with gloo (default), or one GPU per rank with NCCL (cuda)",
    )
    parser.add_argument("--nodes", type=int, choices=(1, 2), default=1, help="simulated nodes on localhost")
    parser.add_argument(
        "--formats", default=",".join(FORMATS), help=f"comma-separated subset of {','.join(FORMATS)} (default: all)"
    )
    parser.add_argument(
        "--implementations",
        default="upstream,core,ours",
        help="comma-separated: upstream, core (Lightning's strategies with only the core's shard-local loading,"
        " `lightning_fsdp.core`), ours, s3 (ours, loading the same files from moto's S3 server on loopback),"
        " s3-client-in-base (the same, with the S3 client created before the base), master-s3 (Lightning master's"
        " `load_checkpoint` on the s3:// URL; needs --lightning-master)",
    )
    parser.add_argument(
        "--s3-server",
        choices=SERVERS,
        default="stock",
        help="the S3 server of the remote rows: moto as it is (stock, default), or with the benchmark's shim that"
        " serves a byte range by a seek and a read (ranged)",
    )
    parser.add_argument(
        "--s3-server-cap", type=parse_bytes, default=None, help="run the S3 server in a memory cgroup of this size"
    )
    parser.add_argument(
        "--lightning-master",
        type=Path,
        default=None,
        help="the `src` folder of a Lightning checkout, put first on the PYTHONPATH of the master-s3 rows' ranks",
    )
    parser.add_argument(
        "--strategy",
        choices=("fsdp", "fsdp2", "both"),
        default="both",
        help="FSDPStrategy (fsdp: FSDP1), ModelParallelStrategy with fully_shard (fsdp2: FSDP2), or both (default)",
    )
    parser.add_argument(
        "--load-concurrency",
        default=None,
        help="comma-separated k values for lightning-fsdp (int, 'all', 'auto'); default: 1,all for the legacy"
        " format, the strategy's default otherwise",
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "lightning_fsdp_bench",
        help="checkpoints, logs, results (default: %(default)s)",
    )
    parser.add_argument("--output", type=Path, default=None, help="also write the Markdown table to this file")
    parser.add_argument("--json", type=Path, default=None, help="all numbers (default: WORKDIR/results.json)")
    parser.add_argument(
        "--cache",
        choices=("cold", "file", "warm"),
        default="cold",
        help="page cache before each load: cold (drop all of it, needs root), file (evict only the checkpoint's"
        " pages), warm (read the checkpoint once) (default: cold)",
    )
    parser.add_argument("--interval", type=float, default=10.0, help="sampling interval in ms (default: 10)")
    parser.add_argument("--settle", type=float, default=None, help="seconds the ranks idle before and after a load")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds before a run is killed")
    parser.add_argument("--rewrite", action="store_true", help="rewrite the checkpoints even if they exist")
    parser.add_argument(
        "--retry-busy",
        type=int,
        default=1,
        help=f"run a load again (up to this many times) when other processes used over {_BUSY_MACHINE} cores during"
        " it, and keep the quietest run (default: 1)",
    )
    capacity = parser.add_argument_group("capacity mode")
    capacity.add_argument(
        "--capacity",
        action="store_true",
        help="find the largest full checkpoint with Adam state that loads under --cap, per strategy and implementation",
    )
    capacity.add_argument("--cap", type=parse_bytes, default="6GiB", help="memory cap of the whole job (default: 6GiB)")
    capacity.add_argument("--capacity-width", type=int, default=1024, help="width of the models tried (default: 1024)")
    capacity.add_argument("--capacity-start", type=int, default=1, help="first depth tried, then doubled (default: 1)")
    capacity.add_argument("--capacity-max-depth", type=int, default=256, help="largest depth tried (default: 256)")
    capacity.add_argument(
        "--capacity-bisections", type=int, default=1, help="bisection steps after the doubling (default: 1)"
    )
    args = parser.parse_args(argv)
    args.strategies = list(STRATEGIES) if args.strategy == "both" else [args.strategy]

    args.formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    args.implementations = [i.strip() for i in args.implementations.split(",") if i.strip()]
    if args.load_concurrency is not None:
        args.load_concurrency = [k.strip() for k in args.load_concurrency.split(",") if k.strip()]
        if bad := [k for k in args.load_concurrency if not (k.isdigit() and int(k) > 0) and k not in ("all", "auto")]:
            parser.error(f"--load-concurrency takes positive integers, 'all' and 'auto', got {bad}")
    if unknown := set(args.formats) - set(FORMATS):
        parser.error(f"unknown formats {sorted(unknown)}")
    if unknown := set(args.implementations) - {"upstream", "core", "ours", *REMOTE_IMPLEMENTATIONS}:
        parser.error(f"unknown implementations {sorted(unknown)}")
    if args.ranks % args.nodes:
        parser.error("--ranks must be a multiple of --nodes")
    if args.device == "cuda" and (problem := _cuda_problem(args)):
        parser.error(problem)
    width, depth, size_label = args.size
    if args.settle is None:
        args.settle = 0.3 if width * depth < 4096 else 1.0

    machine = _machine(args.workdir)
    if args.capacity:
        return _capacity(args, machine)
    args.master_problem = _master_problem(args.lightning_master) if "master-s3" in args.implementations else None
    meta = write_checkpoints(args.workdir, width, depth, args.formats, args.rewrite)
    remote = set(args.implementations) & set(REMOTE_IMPLEMENTATIONS)
    store = start_object_store(meta, args.workdir, args.s3_server, args.s3_server_cap) if remote else None
    try:
        return _run_cases(args, meta, machine, size_label, store)
    finally:
        if store is not None:
            store.stop()


def _run_cases(
    args: argparse.Namespace, meta: dict[str, Any], machine: dict[str, str], size_label: str, store: Any
) -> int:
    cases = _cases(args)
    results = []
    for index, case in enumerate(cases, 1):
        if case.unavailable:
            _log(f"[{index}/{len(cases)}] {case.title} / {case.label}: {case.unavailable}")
            results.append((case, {}))
            continue
        _log(f"[{index}/{len(cases)}] {STRATEGY_TITLES[case.strategy]}: {case.title} / {case.label} ...")
        trusted = "" if case.weights_only else "-trusted"
        name = f"{case.strategy}-{case.format}{trusted}-{case.implementation}-k{case.load_concurrency}"
        run_dir = args.workdir / "runs" / name
        result = run_case(args, meta, case, run_dir, store=store)
        for _ in range(args.retry_busy):
            if result.get("other_cpu_cores", 0.0) <= _BUSY_MACHINE:
                break
            _log(f"    other processes used {result['other_cpu_cores']:.2f} cores during the load: once more")
            again = run_case(args, meta, case, run_dir, store=store)
            if "error" not in again and again.get("other_cpu_cores", 0.0) < result["other_cpu_cores"]:
                result = again
        if "error" not in result:
            _log(
                f"    {result['load_seconds']:.2f} s, peak PSS {_gb(result['peak_pss'])}"
                f" (base {_gb(result['base_pss'])}), peak anonymous {_gb(result['peak_anon'])},"
                f" correct: {result['correct']}"
            )
        results.append((case, result))

    table = render(args, meta, machine, results, size_label)
    print(table)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(table)
    json_path = args.json or args.workdir / "results.json"
    json_path.write_text(
        json.dumps(
            {
                "machine": machine,
                "size": size_label,
                "ranks": args.ranks,
                "nodes": args.nodes,
                "files": meta["files"],
                "s3_server": args.s3_server if store is not None else None,
                "lightning_master": str(args.lightning_master) if args.lightning_master else None,
                "results": [{"case": vars(case), **result} for case, result in results],
            },
            indent=1,
        )
    )
    return 0


def _capacity(args: argparse.Namespace, machine: dict[str, str]) -> int:
    if args.capacity_start < 1 or args.capacity_max_depth < args.capacity_start:
        raise SystemExit("bench_load: error: need 1 <= --capacity-start <= --capacity-max-depth")
    table, summary = run_capacity(args, _capacity_cases(args))
    print(table)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(table)
    json_path = args.json or args.workdir / "capacity.json"
    json_path.write_text(
        json.dumps({"machine": machine, "cap": args.cap, "ranks": args.ranks, "nodes": args.nodes, **summary}, indent=1)
    )
    return 0
