"""The ``lightning-fsdp`` command: inspect a checkpoint, convert it into a sharded checkpoint, or consolidate one.

Each command imports only what it needs, inside its own function: ``inspect`` reads a file's structure with torch and
this package's readers, and never imports Lightning or torch's FSDP and distributed checkpoint modules, which take
seconds to import.

Layer: an extension of the package (docs/source-fabric/upstream.rst), not part of the core.
"""

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence

from lightning_fsdp.__about__ import __version__

_DESCRIPTION = """\
Inspect and convert the checkpoints that lightning_fsdp.FSDPStrategy loads: raw module state dicts (torch.save, zip
or legacy format), safetensors files, Hugging Face sharded checkpoints (*.index.json or their directory), and Fabric
checkpoints (full files and sharded directories). The format is told from the content, not the name."""

_EPILOG = """\
examples:
  lightning-fsdp inspect lit-llama.pth
  lightning-fsdp inspect checkpoints/Llama-2-7b-hf --json
  lightning-fsdp convert lit-llama.pth lit-llama-sharded/
      then, in the training script: fabric.load("lit-llama-sharded/", {"model": model})
  lightning-fsdp convert checkpoints/step-1000/ step-1000.ckpt
      a sharded (distributed) checkpoint directory into one torch.save file, one tensor at a time"""

#: The exit code of a process killed by ``SIGPIPE`` (128 + 13), as shells report it for ``yes | head -1``.
_EXIT_BROKEN_PIPE = 141


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit code.

    0 on success, 2 on bad input or any other failure (reported as one line on stderr, never as a traceback), 130 on
    Ctrl-C, and 141 (like a program killed by ``SIGPIPE``) when the reader of the output went away, e.g. ``| head``.

    """
    started = time.perf_counter()
    parser = _parser()
    args = parser.parse_args(argv)
    args.started = started
    try:
        code = _inspect(args) if args.command == "inspect" else _convert(args)
        sys.stdout.flush()  # here, so that a closed pipe is reported below rather than at interpreter shutdown
        return code
    except KeyboardInterrupt:
        print("lightning-fsdp: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        _silence_stdout()
        return _EXIT_BROKEN_PIPE
    except SystemExit:
        raise
    except BaseException as error:  # torch's `CheckpointException` derives from BaseException, not Exception
        print(f"lightning-fsdp {args.command}: error: {_error_message(error)}", file=sys.stderr)
        return 2


def _silence_stdout() -> None:
    """Point standard output at ``/dev/null``, so that the interpreter's final flush does not fail a second time."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no real file descriptor (e.g. stdout replaced in tests): nothing will flush it
        pass


def _error_message(error: BaseException) -> str:
    """One line for ``error``: its message, its type for errors that are not the loader's own, and no traceback.

    Multi-line messages keep their first line on the error line and the rest indented below it. The errors of torch's
    distributed checkpoint reader, whose text embeds each rank's traceback, are reduced to each rank's error.

    """
    from lightning_fsdp.loading.errors import CheckpointLoadError, printable

    try:
        from torch.distributed.checkpoint.api import CheckpointException
    except ImportError:  # the failure may be that torch itself is broken
        CheckpointException = ()
    if isinstance(error, CheckpointException) and error.failures:
        causes = []
        for rank, (cause, _) in sorted(error.failures.items()):
            causes.append(f"rank {rank}: {_error_message(cause)}")
        return "the distributed checkpoint reader failed on " + "; ".join(causes)

    text = str(error).strip()
    if not isinstance(error, (CheckpointLoadError, OSError)):
        text = f"{type(error).__name__}: {text}" if text else type(error).__name__
    first, *rest = [printable(line) for line in text.split("\n")] or [type(error).__name__]
    return "\n".join([first, *(f"    {line}" for line in rest if line.strip())])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-fsdp",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    inspect = commands.add_parser(
        "inspect",
        help="show the format, size, dtypes and keys of a checkpoint (reads no tensor data)",
        description="Show what a checkpoint holds: its format and how it was detected, whether ranks can read it"
        " lazily, the number of tensors and bytes, their dtypes, and the top-level keys; then how long it took.",
    )
    inspect.add_argument("path", help="a checkpoint file or directory")
    inspect.add_argument(
        "--json", action="store_true", help="print a JSON object, for scripts (without the closing `time:` line)"
    )
    _add_weights_only(inspect)

    convert = commands.add_parser(
        "convert",
        help="write a sharded checkpoint that fabric.load reads shard by shard, or consolidate one into a file",
        description="Convert a checkpoint (any format `inspect` reads) into a sharded (torch distributed) checkpoint"
        " directory, tensor by tensor and in row chunks, so that memory stays near the largest chunk. Load the"
        " result with `fabric.load(OUT, {KEY: model})`. A Fabric checkpoint's optimizer state is not converted."
        " A sharded checkpoint directory (one with a `.metadata` file, as `fabric.save` writes it) is converted the"
        " other way: into the one `torch.save` file that Lightning's `consolidate_checkpoint` writes, optimizer"
        " state included, one tensor at a time (`--key` and `--chunk-mb` do not apply).",
    )
    convert.add_argument("path", help="the checkpoint to convert")
    convert.add_argument(
        "output",
        help="the directory to write (must not exist, or be empty); for a sharded PATH, the file to write (must not"
        " exist)",
    )
    convert.add_argument("--key", default="model", help="the key of the module's state (default: %(default)s)")
    convert.add_argument(
        "--chunk-mb",
        type=float,
        default=32,
        help="approximate size of each written chunk in MiB (default: %(default)s)",
    )
    convert.add_argument("--no-progress", action="store_true", help="do not show a progress bar")
    _add_weights_only(convert)
    return parser


def _add_weights_only(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--unsafe-unpickle",
        action="store_true",
        help="allow arbitrary objects in pickled files (weights_only=False); only for files you trust",
    )


def _inspect(args: argparse.Namespace) -> int:
    from lightning_fsdp.loading.convert import describe_checkpoint
    from lightning_fsdp.loading.errors import printable

    summary = describe_checkpoint(args.path, weights_only=not args.unsafe_unpickle)
    if args.json:
        print(json.dumps(summary.as_dict(), indent=2))
        return 0
    dtypes = ", ".join(f"{dtype} ({count})" for dtype, count in summary.dtypes.items()) or "none"
    # Names come from the file: shown escaped, so that a name cannot write to the terminal.
    keys = summary.top_level_keys
    shown_keys = ", ".join(map(printable, keys[:8])) + (f", ... ({len(keys)} in all)" if len(keys) > 8 else "")
    lines = [
        ("path", summary.path),
        ("format", f"{summary.format} ({summary.kind})"),
        ("lazy", "yes: each rank reads only its own slices" if summary.lazy else "no: read whole, in node turns"),
        ("files", f"{summary.files} ({_size(summary.file_bytes)})"),
        ("tensors", f"{summary.tensors} ({_size(summary.tensor_bytes)})"),
        ("dtypes", dtypes),
        ("largest", f"{printable(str(summary.largest_tensor))} ({_size(summary.largest_tensor_bytes)})"),
        ("keys", shown_keys or "none"),
    ]
    for label, value in lines:
        print(f"{label + ':':<9} {value}")
    # Imports included: on a busy machine, importing torch is most of it.
    reading = time.perf_counter() - args.started
    total = _seconds_since_process_start()
    if total is None:
        print(f"{'time:':<9} {reading:.2f} s (reading the checkpoint)")
    else:
        print(f"{'time:':<9} {max(total, reading):.2f} s (the command, start-up included; {reading:.2f} s reading)")
    return 0


def _convert(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from lightning_fsdp.loading.convert import convert_checkpoint, describe_checkpoint
    from lightning_fsdp.loading.errors import printable
    from lightning_fsdp.loading.formats import CheckpointFormat

    summary = describe_checkpoint(args.path, weights_only=not args.unsafe_unpickle)
    show = not args.no_progress and sys.stderr.isatty()
    if summary.format == CheckpointFormat.FABRIC_SHARDED.value:
        return _consolidate(args, summary.tensor_bytes, show)
    with tqdm(
        total=summary.tensor_bytes, unit="B", unit_scale=True, desc="converting", disable=not show, file=sys.stderr
    ) as bar:
        result = convert_checkpoint(
            args.path,
            args.output,
            module_key=args.key,
            weights_only=not args.unsafe_unpickle,
            chunk_bytes=int(args.chunk_mb * 2**20),
            on_chunk=bar.update,
        )
    print(
        f"wrote {result.output}: {_counted(result.tensors, 'tensor')}, {_size(result.tensor_bytes)} in"
        f" {_counted(result.chunks, 'chunk')} under {args.key!r}; load it with"
        f" fabric.load({result.output!r}, {{{args.key!r}: model}})"
    )
    if result.metadata_keys:
        print(f"kept metadata: {', '.join(map(printable, result.metadata_keys))}")
    if result.skipped_keys:
        print(
            "not converted (tensors other than the module's, e.g. optimizer state):"
            f" {', '.join(map(printable, result.skipped_keys))}"
        )
    return 0


def _consolidate(args: argparse.Namespace, tensor_bytes: int, show: bool) -> int:
    from tqdm import tqdm

    from lightning_fsdp.loading.errors import printable
    from lightning_fsdp.saving.offline import consolidate_sharded_checkpoint

    with tqdm(
        total=tensor_bytes, unit="B", unit_scale=True, desc="consolidating", disable=not show, file=sys.stderr
    ) as bar:
        result = consolidate_sharded_checkpoint(
            args.path, args.output, weights_only=not args.unsafe_unpickle, on_bytes=bar.update
        )
    others = f", and {_counted(len(result.objects), 'other entry', 'other entries')}" if result.objects else ""
    print(
        f"wrote {result.output}: {_counted(result.tensors, 'tensor')}, {_size(result.tensor_bytes)} (the largest"
        f" {_size(result.largest_tensor_bytes)}){others}; load it with"
        f" torch.load({result.output!r}) or fabric.load({result.output!r}, state)"
    )
    if result.metadata_keys:
        keys = result.metadata_keys
        print(
            f"it also holds {_counted(len(keys), 'entry', 'entries')} from the checkpoint's meta.pt:"
            f" {', '.join(map(printable, keys))}"
        )
    return 0


def _counted(count: int, singular: str, plural: str | None = None) -> str:
    """``count`` and the noun, singular for one (``1 tensor``, ``2 tensors``, ``1 other entry``)."""
    return f"{count} {singular if count == 1 else plural or singular + 's'}"


def _seconds_since_process_start() -> float | None:
    """Wall-clock seconds since this process started (interpreter and imports included); ``None`` off Linux."""
    try:
        with open("/proc/self/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, `starttime`, in clock ticks since boot
        return time.clock_gettime(time.CLOCK_BOOTTIME) - started
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def _size(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


if __name__ == "__main__":
    sys.exit(main())
