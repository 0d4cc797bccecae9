"""Seeded mutations of the structural bytes of checkpoint files, and a child process that loads each mutated file.

A mutation changes the bytes that say where tensor bytes are and what they mean (zip headers, pickles, the safetensors
header, a Hugging Face index, a distributed checkpoint's ``.metadata``), never the tensor bytes themselves. Mutations
that would turn a file into a *valid* checkpoint with other values are not generated, because no reader could tell
them from a real checkpoint: a tensor's strides and pickle memo references (they make a valid view of other bytes),
and a safetensors dtype of the same item size.

The mutated files are loaded in a child process, one (mutation, entry point) job after another, so that a crash
(``SIGBUS``, ``SIGSEGV``) or a hang is reported with the job that caused it and the rest still runs in a new child.
"""

import dataclasses
import io
import json
import math
import multiprocessing
import os
import pickle
import pickletools
import random
import shutil
import signal
import struct
import time
import traceback
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Written in place of the mutation's directory in a file's content (for absolute paths in an index).
ROOT_PLACEHOLDER = "@ROOT@"

#: The entry points every mutated file goes through.
ENTRY_POINTS = ("load", "inspect", "convert")
#: Entry points that misbehave on purpose, to test that the harness reports each way a job can fail.
SELF_TEST_ENTRY_POINTS = ("_crash", "_hang", "_raise")

#: Every parameter and buffer of a fresh model is filled with this before a load: a tensor that a load skips shows.
_SENTINEL = -12345.0


@dataclass(frozen=True)
class Mutation:
    """One mutated checkpoint: the original's files, with ``target`` replaced by ``content``."""

    fmt: str
    kind: str
    target: str
    """The mutated file, relative to the checkpoint directory."""
    offset: int
    """The byte offset in ``target`` that the mutation changed (or where it truncated the file)."""
    detail: str
    content: bytes
    extra: tuple[tuple[str, bytes], ...] = ()
    """Other files to create, relative to the mutation's directory (the checkpoint directory is ``ckpt`` in it)."""

    def describe(self, seed: int) -> str:
        return f"{self.fmt} | {self.kind} | {self.target}@{self.offset} | {self.detail} | seed {seed}"


@dataclass(frozen=True)
class Original:
    """An unmutated checkpoint: a directory, and the path in it that a user passes to load it."""

    fmt: str
    directory: Path
    entry: str
    """Relative to ``directory``; ``"."`` for the directory itself."""


def materialize(mutation: Mutation, original: Original, root: Path) -> Path:
    """Write the mutated checkpoint under ``root`` (unchanged files are hard links); return the path to load."""
    checkpoint = root / "ckpt"
    for source in sorted(original.directory.rglob("*")):
        relative = source.relative_to(original.directory)
        destination = checkpoint / relative
        if source.is_dir():
            destination.mkdir(parents=True, exist_ok=True)
            continue
        destination.parent.mkdir(parents=True, exist_ok=True)
        if relative.as_posix() == mutation.target:
            destination.write_bytes(mutation.content.replace(ROOT_PLACEHOLDER.encode(), _json_path(root)))
        else:
            try:
                os.link(source, destination)
            except OSError:
                shutil.copyfile(source, destination)
    for relative, content in mutation.extra:
        destination = root / relative
        destination.parent.mkdir(parents=True, exist_ok=True)
        destination.write_bytes(content)
    return checkpoint / original.entry


def _json_path(root: Path) -> bytes:
    return json.dumps(str(root))[1:-1].encode()


# ---------------------------------------------------------------------------------------------------------------------
# Sampling


@dataclass(frozen=True)
class _Candidate:
    offset: int
    detail: str
    apply: Callable[[], bytes]
    extra: tuple[tuple[str, bytes], ...] = ()


def sample(
    seed: int, fmt: str, target: str, candidates: dict[str, list[_Candidate]], counts: dict[str, int]
) -> list[Mutation]:
    """Draw ``counts[kind]`` candidates of each kind, each kind from a random stream of its own (seeded)."""
    mutations = []
    for kind, count in counts.items():
        pool = candidates.get(kind, [])
        if not pool:
            raise AssertionError(f"{fmt}: no candidate mutation of kind {kind!r} (the generator no longer matches)")
        rng = random.Random(f"{seed}:{fmt}:{target}:{kind}")
        for candidate in rng.sample(pool, min(count, len(pool))):
            content = candidate.apply()
            mutations.append(Mutation(fmt, kind, target, candidate.offset, candidate.detail, content, candidate.extra))
    return mutations


def _flip(rng: random.Random, data: bytes, offset: int) -> tuple[bytes, str]:
    mask = rng.randrange(1, 256)
    new = data[offset] ^ mask
    return data[:offset] + bytes([new]) + data[offset + 1 :], f"byte {data[offset]:#04x} -> {new:#04x}"


def _flips(
    seed: str,
    data: bytes,
    offsets: Iterable[int],
    label: Callable[[int], str],
    finish: Callable[[bytes], bytes] = lambda data: data,
) -> list[_Candidate]:
    """Each byte at ``offsets`` XORed with a random non-zero mask (drawn from a stream seeded by the offset)."""
    candidates = []
    for offset in offsets:
        rng = random.Random(f"{seed}:{offset}")
        mutated, change = _flip(rng, data, offset)
        candidates.append(_Candidate(offset, f"{label(offset)}: {change}", lambda mutated=mutated: finish(mutated)))
    return candidates


def _patch(data: bytes, offset: int, new: bytes) -> bytes:
    return data[:offset] + new + data[offset + len(new) :]


def _int_values(value: int, width: int, signed: bool) -> list[tuple[str, int]]:
    """Extreme and off-by-one values for an integer field of ``width`` bytes."""
    bits = 8 * width
    low, high = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)
    values = [("0", 0), ("max", high), ("+1", value + 1), ("-1", value - 1)]
    if signed:
        values += [("min", low), ("= -1", -1)]
    return [(label, new) for label, new in values if low <= new <= high and new != value]


def _field_candidates(data: bytes, fields: Iterable["_Field"], finish: Callable[[bytes], bytes]) -> list[_Candidate]:
    candidates = []
    for item in fields:
        for label, new in _int_values(item.value, item.width, item.signed):
            encoded = new.to_bytes(item.width, "little", signed=item.signed)
            mutated = _patch(data, item.offset, encoded)
            candidates.append(
                _Candidate(
                    item.offset,
                    f"{item.name} {item.value} -> {new} ({label})",
                    lambda mutated=mutated: finish(mutated),
                )
            )
    return candidates


@dataclass
class _Field:
    name: str
    offset: int
    width: int
    value: int
    signed: bool = False


def _truncations(data: bytes, offsets: Iterable[tuple[int, str]]) -> list[_Candidate]:
    return [
        _Candidate(offset, f"truncated to {offset} of {len(data)} bytes ({label})", lambda offset=offset: data[:offset])
        for offset, label in offsets
        if 0 <= offset < len(data)
    ]


# ---------------------------------------------------------------------------------------------------------------------
# Pickles

_LENGTH_ARGS = {
    "BINUNICODE": (4, False),
    "SHORT_BINUNICODE": (1, False),
    "BINUNICODE8": (8, False),
    "BINBYTES": (4, False),
    "SHORT_BINBYTES": (1, False),
    "BINBYTES8": (8, False),
    "BYTEARRAY8": (8, False),
    "BINSTRING": (4, True),
    "SHORT_BINSTRING": (1, False),
    "LONG1": (1, False),
    "LONG4": (4, True),
    "FRAME": (8, False),
}
_INT_ARGS = {"BININT1": (1, False), "BININT2": (2, False), "BININT": (4, True)}
_TUPLE_OPCODES = {"TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "EMPTY_TUPLE", "BINGET", "LONG_BINGET"}


@dataclass
class _PickleMap:
    start: int
    end: int
    """Just past the STOP opcode."""
    opcodes: list[tuple[int, str]] = field(default_factory=list)
    lengths: list[_Field] = field(default_factory=list)
    ints: list[_Field] = field(default_factory=list)
    """Integer arguments, named by their role in a torch tensor's pickle: ``numel`` (of a storage), ``storage offset``,
    ``size``, ``stride``, or ``int`` for any other."""


def map_pickle(data: bytes, start: int = 0) -> _PickleMap:
    """Where the opcodes, the length prefixes and the integer arguments of the pickle at ``data[start:]`` are."""
    result = _PickleMap(start, start)
    tensor_part: str | None = None  # after a storage (BINPERSID): its offset, then the size tuple, then the strides
    ints_since_mark: list[_Field] = []
    for opcode, arg, position in pickletools.genops(io.BytesIO(data[start:])):
        offset = start + position
        name = opcode.name
        result.opcodes.append((offset, name))
        if name in _LENGTH_ARGS:
            width, signed = _LENGTH_ARGS[name]
            length = int.from_bytes(data[offset + 1 : offset + 1 + width], "little", signed=signed)
            result.lengths.append(_Field(f"{name} length", offset + 1, width, length, signed))
        int_field = None
        if name in _INT_ARGS:
            width, signed = _INT_ARGS[name]
            int_field = _Field("int", offset + 1, width, arg, signed)
        elif name == "LONG1" and data[offset + 1] > 0:
            int_field = _Field("int", offset + 2, data[offset + 1], arg, True)
        if int_field is not None:
            if tensor_part == "offset":
                int_field.name, tensor_part = "storage offset", "size"
            elif tensor_part in ("size", "stride"):
                int_field.name = tensor_part
            result.ints.append(int_field)
            ints_since_mark.append(int_field)
        if name == "MARK":
            ints_since_mark = []
        elif name == "BINPERSID":
            if ints_since_mark:
                ints_since_mark[-1].name = "numel"
            tensor_part = "offset"
        elif name in _TUPLE_OPCODES and tensor_part in ("size", "stride"):
            tensor_part = "stride" if tensor_part == "size" else None
        if name == "STOP":
            result.end = offset + 1
    return result


def pickle_candidates(
    seed: str,
    data: bytes,
    pickles: list[_PickleMap],
    finish: Callable[[bytes], bytes] = lambda data: data,
    int_roles: tuple[str, ...] = ("numel", "storage offset", "size"),
    truncate: bool = True,
) -> dict[str, list[_Candidate]]:
    """Opcode flips, length prefixes and integers set to extremes, and truncations (or an early STOP) of pickles.

    Args:
        finish: Applied to every mutated file (e.g. to fix the CRC of a zip record).
        int_roles: Which integers to mutate (see :class:`_PickleMap`). Strides are left alone: changed, they describe
            a valid view of other bytes.
        truncate: Cut the file at an opcode; otherwise write a STOP there (the pickle ends early, the file does not).

    """
    opcodes = [(offset, name) for pickled in pickles for offset, name in pickled.opcodes]
    candidates: dict[str, list[_Candidate]] = {}
    names = dict(opcodes)
    candidates["pickle opcode"] = _flips(
        f"{seed}:opcode", data, list(names), lambda offset: f"opcode {names[offset]}", finish
    )
    lengths = [item for pickled in pickles for item in pickled.lengths]
    candidates["pickle length"] = _field_candidates(data, lengths, finish)
    ints = [item for pickled in pickles for item in pickled.ints if item.name in int_roles]
    candidates["pickle int"] = _field_candidates(data, ints, finish)
    if truncate:
        candidates["pickle truncate"] = _truncations(data, [(offset, f"at opcode {name}") for offset, name in opcodes])
    else:
        candidates["pickle stop"] = [
            _Candidate(
                offset, f"STOP written over opcode {name}", lambda offset=offset: finish(_patch(data, offset, b"."))
            )
            for offset, name in opcodes
            if name != "STOP"
        ]
    return candidates


# ---------------------------------------------------------------------------------------------------------------------
# Zip archives (torch.save's default format)

_LOCAL = b"PK\x03\x04"
_CENTRAL = b"PK\x01\x02"
_END = b"PK\x05\x06"
_END64 = b"PK\x06\x06"
_LOCATOR64 = b"PK\x06\x07"


@dataclass
class _ZipEntry:
    name: str
    local: int
    central: int
    data: int
    size: int
    name_in_central: int
    """Offset of the name in the central directory record."""
    crc_offsets: tuple[int, int]
    """Offsets of the CRC-32 field in the local and in the central record."""


@dataclass
class _ZipMap:
    entries: list[_ZipEntry]
    fields: list[_Field]
    """The length, offset and count fields of every record."""
    header_bytes: list[tuple[int, str]]
    """Bytes of the records' other fields (version, flags, method, CRC), to flip."""
    signatures: list[tuple[int, str]]
    central_start: int
    end_records: list[tuple[int, str]]


def map_zip(data: bytes) -> _ZipMap:
    """Parse a zip archive from its end-of-central-directory record, as a reader would, recording every field."""
    end = data.rfind(_END)
    assert end >= 0, "not a zip archive"
    fields = [
        _Field("end: entries on this disk", end + 8, 2, _u(data, end + 8, 2)),
        _Field("end: entries", end + 10, 2, _u(data, end + 10, 2)),
        _Field("end: central directory size", end + 12, 4, _u(data, end + 12, 4)),
        _Field("end: central directory offset", end + 16, 4, _u(data, end + 16, 4)),
        _Field("end: comment length", end + 20, 2, _u(data, end + 20, 2)),
    ]
    signatures = [(end, "end of central directory")]
    end_records = [(end, "end of central directory")]
    central_start, count = _u(data, end + 16, 4), _u(data, end + 10, 2)
    header_bytes: list[tuple[int, str]] = []
    locator = end - 20
    if data[locator : locator + 4] == _LOCATOR64:
        end64 = _u(data, locator + 8, 8)
        assert data[end64 : end64 + 4] == _END64
        signatures += [(locator, "zip64 locator"), (end64, "zip64 end of central directory")]
        end_records += [(locator, "zip64 locator"), (end64, "zip64 end of central directory")]
        fields += [
            _Field("zip64 locator: end record offset", locator + 8, 8, _u(data, locator + 8, 8)),
            _Field("zip64 locator: disks", locator + 16, 4, _u(data, locator + 16, 4)),
            _Field("zip64 end: record size", end64 + 4, 8, _u(data, end64 + 4, 8)),
            _Field("zip64 end: entries on this disk", end64 + 24, 8, _u(data, end64 + 24, 8)),
            _Field("zip64 end: entries", end64 + 32, 8, _u(data, end64 + 32, 8)),
            _Field("zip64 end: central directory size", end64 + 40, 8, _u(data, end64 + 40, 8)),
            _Field("zip64 end: central directory offset", end64 + 48, 8, _u(data, end64 + 48, 8)),
        ]
        header_bytes += [(end64 + offset, "zip64 end: version") for offset in range(12, 16)]
        central_start, count = _u(data, end64 + 48, 8), _u(data, end64 + 32, 8)
    entries = []
    central = central_start
    for _ in range(count):
        assert data[central : central + 4] == _CENTRAL
        name_length, extra_length, comment_length = (_u(data, central + offset, 2) for offset in (28, 30, 32))
        name = data[central + 46 : central + 46 + name_length].decode()
        local = _u(data, central + 42, 4)
        assert data[local : local + 4] == _LOCAL
        local_name, local_extra = _u(data, local + 26, 2), _u(data, local + 28, 2)
        size = _u(data, central + 20, 4)
        entries.append(
            _ZipEntry(
                name,
                local,
                central,
                local + 30 + local_name + local_extra,
                size,
                central + 46,
                (local + 14, central + 16),
            )
        )
        signatures += [(local, f"local header of {name!r}"), (central, f"central record of {name!r}")]
        for label, base, layout in (("local", local, _LOCAL_FIELDS), ("central", central, _CENTRAL_FIELDS)):
            for field_name, offset, width in layout:
                fields.append(
                    _Field(f"{label} {field_name} of {name!r}", base + offset, width, _u(data, base + offset, width))
                )
        for label, base, spans in (("local", local, ((4, 14), (14, 18))), ("central", central, ((4, 12), (16, 20)))):
            for start, stop in spans:
                header_bytes += [(base + offset, f"{label} header of {name!r}") for offset in range(start, stop)]
        central += 46 + name_length + extra_length + comment_length
    return _ZipMap(entries, fields, header_bytes, signatures, central_start, end_records)


_LOCAL_FIELDS = (("compressed size", 18, 4), ("size", 22, 4), ("name length", 26, 2), ("extra length", 28, 2))
_CENTRAL_FIELDS = (
    ("compressed size", 20, 4),
    ("size", 24, 4),
    ("name length", 28, 2),
    ("extra length", 30, 2),
    ("comment length", 32, 2),
    ("local header offset", 42, 4),
)


def _u(data: bytes, offset: int, width: int) -> int:
    return int.from_bytes(data[offset : offset + width], "little")


def zip_candidates(seed: str, data: bytes) -> dict[str, list[_Candidate]]:
    """Mutations of a zip archive's records and of the pickle in its ``data.pkl`` record (with its CRC fixed)."""
    layout = map_zip(data)
    candidates: dict[str, list[_Candidate]] = {}
    candidates["zip field"] = _field_candidates(data, layout.fields, lambda data: data)
    candidates["zip signature"] = _flips(
        f"{seed}:signature",
        data,
        [o + i for o, _ in layout.signatures for i in range(4)],
        _labeller(layout.signatures, 4),
    )
    candidates["zip header byte"] = _flips(
        f"{seed}:header", data, [offset for offset, _ in layout.header_bytes], lambda o: dict(layout.header_bytes)[o]
    )
    cuts = [(entry.local, f"at the local header of {entry.name!r}") for entry in layout.entries]
    cuts += [(entry.data, f"at the data of {entry.name!r}") for entry in layout.entries]
    cuts += [
        (entry.data + entry.size // 2, f"in the data of {entry.name!r}") for entry in layout.entries if entry.size > 1
    ]
    cuts += [(layout.central_start, "at the central directory")]
    cuts += [(entry.central, f"at the central record of {entry.name!r}") for entry in layout.entries]
    cuts += [(offset + 1, f"just after the {label} signature starts") for offset, label in layout.end_records]
    cuts += [(offset, f"at the {label}") for offset, label in layout.end_records] + [(len(data) - 1, "last byte")]
    candidates["zip truncate"] = _truncations(data, cuts)
    candidates["zip duplicate name"] = [
        _Candidate(
            entry.name_in_central,
            f"{entry.name!r} renamed {other.name!r} in its local and central records: two entries of that name",
            lambda entry=entry, other=other: _rename(data, entry, other.name),
        )
        for entry in layout.entries
        for other in layout.entries
        if other is not entry and len(other.name) == len(entry.name)
    ]
    pickle_entry = next(entry for entry in layout.entries if entry.name.endswith("data.pkl"))
    pickled = map_pickle(data[: pickle_entry.data + pickle_entry.size], pickle_entry.data)
    for kind, pool in pickle_candidates(
        f"{seed}:data.pkl", data, [pickled], finish=lambda data: _fix_crc(data, pickle_entry), truncate=False
    ).items():
        candidates[f"data.pkl {kind.removeprefix('pickle ')}"] = pool
    return candidates


def _labeller(spans: list[tuple[int, str]], width: int) -> Callable[[int], str]:
    def label(offset: int) -> str:
        return next(f"signature of {name}" for start, name in spans if start <= offset < start + width)

    return label


def _rename(data: bytes, entry: _ZipEntry, name: str) -> bytes:
    data = _patch(data, entry.name_in_central, name.encode())
    return _patch(data, entry.local + 30, name.encode())


def _fix_crc(data: bytes, entry: _ZipEntry) -> bytes:
    crc = (zlib.crc32(data[entry.data : entry.data + entry.size]) & 0xFFFFFFFF).to_bytes(4, "little")
    for offset in entry.crc_offsets:
        data = _patch(data, offset, crc)
    return data


# ---------------------------------------------------------------------------------------------------------------------
# torch.save's legacy format: five pickles, then each storage's element count and bytes

_ITEM_SIZES = {
    "DoubleStorage": 8,
    "FloatStorage": 4,
    "HalfStorage": 2,
    "BFloat16Storage": 2,
    "LongStorage": 8,
    "IntStorage": 4,
    "ShortStorage": 2,
    "CharStorage": 1,
    "ByteStorage": 1,
    "BoolStorage": 1,
}


class _StorageRecorder(pickle.Unpickler):
    """Reads the structure of a legacy object pickle without torch: every class is a stub, storages are recorded."""

    def __init__(self, file: Any) -> None:
        super().__init__(file)
        self.item_sizes: dict[str, int] = {}

    def find_class(self, module: str, name: str) -> Any:
        return _Stub(name)

    def persistent_load(self, saved_id: Any) -> Any:
        _, storage_type, key, _location, _numel, _view = saved_id
        self.item_sizes[key] = _ITEM_SIZES[storage_type.name]
        return None


class _Stub:
    def __init__(self, name: str = "") -> None:
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> "_Stub":
        return _Stub()

    def __setstate__(self, state: Any) -> None:
        pass


def legacy_candidates(seed: str, data: bytes) -> dict[str, list[_Candidate]]:
    """Mutations of the five pickles at the start of a legacy file, and of the 8-byte element count of each storage."""
    pickles = _legacy_pickles(data)
    position = pickles[-1].end
    recorder = _StorageRecorder(io.BytesIO(data[pickles[3].start : pickles[3].end]))
    recorder.load()
    keys = pickle.loads(data[pickles[4].start : pickles[4].end])
    counts = []
    for key in keys:
        (numel,) = struct.unpack_from("<q", data, position)
        counts.append(_Field(f"element count of storage {key!r}", position, 8, numel, signed=True))
        position += 8 + numel * recorder.item_sizes[key]
    assert position == len(data), "the legacy layout was not understood"
    candidates = pickle_candidates(f"{seed}:pickles", data, pickles)
    candidates["element count"] = _field_candidates(data, counts, lambda data: data)
    for item in counts:  # byte counts that overflow 64 bits, pass 4 GiB, or take in the next storage's bytes
        for label, new in (("2**61", 2**61), ("0xFFFFFFFF", 0xFFFFFFFF), ("x2", 2 * item.value)):
            mutated = _patch(data, item.offset, new.to_bytes(8, "little", signed=True))
            candidates["element count"].append(
                _Candidate(item.offset, f"{item.name} {item.value} -> {new} ({label})", lambda mutated=mutated: mutated)
            )
    cuts = [(p.end, f"after pickle {index}") for index, p in enumerate(pickles)]
    cuts += [(item.offset + 4, f"in the {item.name}") for item in counts]
    cuts += [(item.offset + 8 + 1, f"in the data after the {item.name}") for item in counts]
    candidates["data truncate"] = _truncations(data, cuts)
    return candidates


def _legacy_pickles(data: bytes) -> list[_PickleMap]:
    """The magic number, protocol version, system info, object and storage keys pickles."""
    pickles = [map_pickle(data)]
    for _ in range(4):
        pickles.append(map_pickle(data, pickles[-1].end))
    return pickles


def canonical_legacy_keys(data: bytes) -> bytes:
    """The legacy file with its storages named ``0``, ``1``, ... in the order the object refers to them.

    torch names them by memory address and writes them sorted by name, so every save differs; renamed and reordered,
    the file, and the offsets that mutations are drawn from, are the same in every run.
    """
    pickles = _legacy_pickles(data)
    recorder = _StorageRecorder(io.BytesIO(data[pickles[3].start : pickles[3].end]))
    recorder.load()
    names = {key: str(index) for index, key in enumerate(recorder.item_sizes)}
    blocks = {}
    position = pickles[4].end
    for key in pickle.loads(data[pickles[4].start : pickles[4].end]):
        (numel,) = struct.unpack_from("<q", data, position)
        end = position + 8 + numel * recorder.item_sizes[key]
        blocks[names[key]] = data[position:end]
        position = end
    head = data[: pickles[3].end]
    for key, name in names.items():
        assert _binunicode(key) in head
        head = head.replace(_binunicode(key), _binunicode(name))
    order = sorted(blocks)  # as torch writes them: sorted by name
    return head + pickle.dumps(order, protocol=2) + b"".join(blocks[name] for name in order)


def _binunicode(text: str) -> bytes:
    # Protocol 2 pickles strings as BINUNICODE: 'X', a 4-byte length, then the UTF-8 text.
    return b"X" + len(text.encode()).to_bytes(4, "little") + text.encode()


def canonical_dcp_metadata(data: bytes) -> bytes:
    """The ``.metadata`` of a distributed checkpoint without its save id and its path, which differ in every run."""
    metadata = pickle.loads(data)
    if metadata.storage_meta is not None:
        metadata.storage_meta = dataclasses.replace(metadata.storage_meta, checkpoint_id=None, save_id="fuzz")
    return pickle.dumps(metadata, protocol=data[1])


# ---------------------------------------------------------------------------------------------------------------------
# safetensors: an 8-byte header length, a JSON header, the data

#: Dtype names whose item size differs from float32's (a same-size dtype would make a valid file with other values).
_OTHER_DTYPES = ("F16", "BF16", "F64", "I64", "I16", "I8", "U8", "BOOL", "F8_E4M3", "f32", "F33", "", "FLOAT32")


def safetensors_candidates(seed: str, data: bytes) -> dict[str, list[_Candidate]]:
    length = _u(data, 0, 8)
    header_text = data[8 : 8 + length].decode()
    header = json.loads(header_text)
    names = [name for name in header if name != "__metadata__"]
    body = len(data) - 8 - length

    def rewrite(items: list[tuple[str, Any]]) -> bytes:
        text = "{" + ",".join(f"{json.dumps(key)}:{json.dumps(value)}" for key, value in items) + "}"
        encoded = text.encode()
        encoded += b" " * (-len(encoded) % 8)
        return len(encoded).to_bytes(8, "little") + encoded + data[8 + length :]

    def changed(name: str, key: str, value: Any) -> Callable[[], bytes]:
        return lambda: rewrite([(n, {**e, key: value} if n == name else e) for n, e in header.items()])

    candidates: dict[str, list[_Candidate]] = {}
    values = [("0", 0), ("1", 1), ("7", 7), ("-1", length - 1), ("+1", length + 1), ("-8", length - 8)]
    values += [("+8", length + 8), ("file size", len(data)), ("2**32-1", 2**32 - 1), ("2**63-1", 2**63 - 1)]
    values += [("2**64-1", 2**64 - 1), ("2**63", 2**63)]
    candidates["header length"] = [
        _Candidate(
            0, f"header length {length} -> {new} ({label})", lambda new=new: _patch(data, 0, new.to_bytes(8, "little"))
        )
        for label, new in values
    ]
    structural = [8 + i for i, char in enumerate(header_text) if char in '{}[]":,']
    candidates["header byte"] = _flips(
        f"{seed}:json", data, structural, lambda offset: f"header char {data[offset : offset + 1]!r}"
    )
    cuts = [(offset, "in the header") for offset in (4, 8, 9)] + [
        (offset, "in the header") for offset in structural[::7]
    ]
    cuts += [(8 + length, "at the data"), (len(data) - 1, "last byte")]
    cuts += [(8 + length + header[name]["data_offsets"][1] - 1, f"in the data of {name!r}") for name in names]
    candidates["truncate"] = _truncations(data, cuts)
    candidates["dtype"] = [
        _Candidate(8, f"{name!r} dtype {header[name]['dtype']} -> {value!r}", changed(name, "dtype", value))
        for name in names
        for value in (*_OTHER_DTYPES, 32, None, ["F32"])
    ]
    shape_values: list[tuple[str, Any]] = []
    for name in names:
        shape = header[name]["shape"]
        options = [("[]", []), ("[0]", [0]), ("negative", [-1] * len(shape)), ("2**63", [2**63, *shape[1:]])]
        options += [("2**64", [2**64, *shape[1:]]), ("huge", [2**31] * 3), ("+1", [shape[0] + 1, *shape[1:]])]
        options += [
            ("-1", [shape[0] - 1, *shape[1:]]),
            ("extra 1", [*shape, 1]),
            ("string", str(shape)),
            ("null", None),
        ]
        options += [
            ("float", [float(d) for d in shape]),
            ("flat", [math.prod(shape)] if len(shape) > 1 else [1, *shape]),
        ]
        if len(shape) > 1:
            options.append(("reversed", shape[::-1]))
        shape_values += [(name, option) for option in options]
    candidates["shape"] = [
        _Candidate(8, f"{name!r} shape {header[name]['shape']} -> {value!r} ({label})", changed(name, "shape", value))
        for name, (label, value) in shape_values
    ]
    offsets: list[_Candidate] = []
    for index, name in enumerate(names):
        begin, end = header[name]["data_offsets"]
        previous = header[names[index - 1]]["data_offsets"] if index else None
        options = [
            ("[0, 0]", [0, 0]),
            ("end+1", [begin, end + 1]),
            ("end-1", [begin, end - 1]),
            ("begin+1", [begin + 1, end]),
        ]
        options += [("begin-1", [begin - 1, end]), ("end 2**64-1", [begin, 2**64 - 1]), ("end 2**63", [begin, 2**63])]
        options += [("negative", [-1, end]), ("past the file", [begin, body + 1]), ("reversed", [end, begin])]
        options += [
            ("shifted past the file", [body, body + end - begin]),
            ("one value", [begin]),
            ("three values", [begin, end, end]),
        ]
        options += [("strings", [str(begin), str(end)]), ("null", None)]
        if previous is not None:
            options.append(("overlapping the previous tensor", [previous[0], previous[0] + end - begin]))
        twins = [other for other in names if other != name and _nbytes(header[other]) == _nbytes(header[name])]
        if twins:
            options.append((f"duplicating {twins[0]!r}", header[twins[0]]["data_offsets"]))
        offsets += [
            _Candidate(
                8, f"{name!r} data_offsets {[begin, end]} -> {value!r} ({label})", changed(name, "data_offsets", value)
            )
            for label, value in options
        ]
    candidates["data offsets"] = offsets
    items = list(header.items())
    candidates["duplicate key"] = [
        _Candidate(
            8,
            f"{name!r} twice, the second time with the entry of {twin!r} (same shape)",
            lambda name=name, twin=twin: rewrite([*items, (name, header[twin])]),
        )
        for name in names
        for twin in names
        if twin != name and header[twin]["shape"] == header[name]["shape"]
    ]
    candidates["missing entry"] = [
        _Candidate(8, f"entry {name!r} removed", lambda name=name: rewrite([(n, e) for n, e in items if n != name]))
        for name in names
    ]
    metadata_values: list[Any] = [{"format": 1}, [], "pt", None, {"format": None}]
    candidates["metadata"] = [
        _Candidate(
            8,
            f"__metadata__ -> {value!r}",
            lambda value=value: rewrite([*[(n, e) for n, e in items if n != "__metadata__"], ("__metadata__", value)]),
        )
        for value in metadata_values
    ]
    return candidates


def _nbytes(entry: dict) -> int:
    begin, end = entry["data_offsets"]
    return end - begin


# ---------------------------------------------------------------------------------------------------------------------
# Hugging Face index: {"metadata": ..., "weight_map": {tensor name: shard file name}}


def index_candidates(
    seed: str, data: bytes, shards: list[str], decoys: dict[str, bytes]
) -> dict[str, list[_Candidate]]:
    """Mutations of an index's JSON. ``decoys`` are shard files with other values, placed where a path could escape."""
    index = json.loads(data)
    weight_map: dict[str, str] = index["weight_map"]
    names = list(weight_map)

    def with_map(items: list[tuple[str, Any]]) -> bytes:
        body = ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in items)
        return f'{{"metadata": {json.dumps(index["metadata"])}, "weight_map": {{{body}}}}}'.encode()

    def pointing(name: str, value: Any) -> Callable[[], bytes]:
        return lambda: with_map([(n, value if n == name else f) for n, f in weight_map.items()])

    candidates: dict[str, list[_Candidate]] = {}
    candidates["escaping path"] = []
    for shard in shards:  # every tensor of the shard moved, so that the index is consistent with the decoy it names
        for value, extra in (
            (f"../{shard}", (shard, decoys[shard])),
            (f"../ckpt/../{shard}", (shard, decoys[shard])),
            (f"{ROOT_PLACEHOLDER}/decoy/{shard}", (f"decoy/{shard}", decoys[shard])),
        ):
            content = with_map([(n, value if f == shard else f) for n, f in weight_map.items()])
            detail = f"every tensor of {shard!r} -> {value!r}, a copy of it with other values"
            candidates["escaping path"].append(_Candidate(0, detail, lambda content=content: content, (extra,)))
    missing = ["model-00003-of-00002.safetensors", "pytorch_model-00003-of-00002.bin", "", ".", "..", "sub", "ckpt"]
    candidates["missing file"] = [
        _Candidate(0, f"{name!r} -> {value!r}", pointing(name, value), (("ckpt/sub/placeholder.txt", b"x"),))
        for name in names
        for value in missing
    ]
    candidates["other shard"] = [
        _Candidate(0, f"{name!r} -> {other!r} (a shard without it)", pointing(name, other))
        for name in names
        for other in shards
        if other != weight_map[name]
    ]
    candidates["not a string"] = [
        _Candidate(0, f"{name!r} -> {value!r}", pointing(name, value))
        for name in names
        for value in (1, None, [weight_map[name]], {})
    ]
    candidates["names"] = [
        _Candidate(
            0,
            f"{name!r} removed from the weight map",
            lambda name=name: with_map([(n, f) for n, f in weight_map.items() if n != name]),
        )
        for name in names
    ] + [
        _Candidate(
            0,
            f"{name + '.extra'!r} added, in {weight_map[name]!r}",
            lambda name=name: with_map([*weight_map.items(), (name + ".extra", weight_map[name])]),
        )
        for name in names
    ]
    candidates["duplicate key"] = [
        _Candidate(
            0,
            f"{name!r} twice, the second time in {other!r}",
            lambda name=name, other=other: with_map([*weight_map.items(), (name, other)]),
        )
        for name in names
        for other in shards
        if other != weight_map[name]
    ]
    structures: list[tuple[str, bytes]] = [
        ("weight_map a list", json.dumps({"weight_map": list(weight_map.items())}).encode()),
        ("weight_map a string", json.dumps({"weight_map": "model.safetensors"}).encode()),
        ("weight_map null", json.dumps({"weight_map": None}).encode()),
        ("weight_map empty", json.dumps({"metadata": index["metadata"], "weight_map": {}}).encode()),
        ("no weight_map", json.dumps({"metadata": index["metadata"]}).encode()),
        ("a list at the top", json.dumps([index]).encode()),
        ("nested weight_map", json.dumps({"weight_map": {"weight_map": weight_map}}).encode()),
    ]
    candidates["structure"] = [_Candidate(0, label, lambda content=content: content) for label, content in structures]
    text = data.decode()
    structural = [i for i, char in enumerate(text) if char in '{}":,']
    candidates["truncate"] = _truncations(data, [(offset, f"at {text[offset]!r}") for offset in structural])
    candidates["json byte"] = _flips(f"{seed}:json", data, structural, lambda offset: f"char {text[offset]!r}")
    return candidates


# ---------------------------------------------------------------------------------------------------------------------
# Running the jobs in a child process


@dataclass(frozen=True)
class Job:
    """One entry point on one mutated file."""

    mutation: int
    entry: str
    """One of :data:`ENTRY_POINTS` (or :data:`SELF_TEST_ENTRY_POINTS`)."""
    path: str


@dataclass(frozen=True)
class Verdict:
    """How a job ended, and whether that is allowed."""

    ok: bool
    outcome: str
    """``refused`` (CheckpointLoadError), ``loaded`` (bit-exact), or what went wrong."""
    seconds: float = 0.0


def run_jobs(
    jobs: list[Job],
    expected_path: Path,
    scratch: Path,
    job_timeout: float,
    budget: float,
    start_timeout: float = 180.0,
) -> dict[int, Verdict]:
    """Run every job in a child process; a crash or a hang fails its job, and a new child takes up the next ones."""
    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    from tests.tests_fabric.helpers.distributed import _PRELOAD

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    verdicts: dict[int, Verdict] = {}
    deadline = time.monotonic() + budget
    next_job, failed_starts = 0, 0
    while next_job < len(jobs):
        if time.monotonic() > deadline:
            for index in range(next_job, len(jobs)):
                verdicts[index] = Verdict(False, f"not run: the fuzz run took more than {budget:.0f} s")
            break
        reader, writer = context.Pipe(duplex=False)
        process = context.Process(
            target=_worker,
            args=(writer, jobs, next_job, str(expected_path), str(scratch), find_free_network_port()),
            daemon=True,
        )
        process.start()
        writer.close()
        in_flight, timeout = None, start_timeout
        try:
            while True:
                if not reader.poll(timeout):
                    raise TimeoutError
                message = reader.recv()
                if message[0] == "ready":
                    timeout = job_timeout
                elif message[0] == "start":
                    in_flight = message[1]
                elif message[0] == "done":
                    verdicts[message[1]] = message[2]
                    in_flight, next_job = None, message[1] + 1
                    if next_job == len(jobs):
                        break
        except TimeoutError:
            if in_flight is None:
                raise AssertionError(f"The fuzz worker did not start within {start_timeout} s") from None
            verdicts[in_flight] = Verdict(False, f"hung: no result within {job_timeout:.0f} s")
            next_job = in_flight + 1
        except EOFError:
            process.join(timeout=10)
            if in_flight is None:
                failed_starts += 1
                if failed_starts > 1 or next_job == 0:
                    raise AssertionError(
                        f"The fuzz worker died before its first job (exit code {process.exitcode})"
                    ) from None
                continue
            verdicts[in_flight] = Verdict(
                False, f"crashed: the process died with {_exit_description(process.exitcode)}"
            )
            next_job = in_flight + 1
        finally:
            reader.close()
            if process.is_alive():
                process.kill()
            process.join(timeout=10)
    return verdicts


def _exit_description(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _worker(conn: Any, jobs: list[Job], first: int, expected_path: str, scratch: str, port: int) -> None:
    import resource
    import warnings

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK="0", LOCAL_RANK="0")
    os.environ["LIGHTNING_FSDP_PROGRESS"] = "0"
    warnings.simplefilter("ignore")
    import torch
    from lightning.fabric import Fabric

    import lightning_fsdp

    torch.set_num_threads(1)
    fabric = Fabric(accelerator="cpu", devices=1, strategy=lightning_fsdp.FSDPStrategy(auto_wrap_policy=_wrap_policy()))
    fabric.launch()
    expected = torch.load(expected_path, weights_only=True)
    # A mutated length may ask for terabytes: such an allocation must fail here, not take the machine's memory.
    virtual = int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (virtual + 3 * 2**30, resource.RLIM_INFINITY))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the file size limit fails instead of killing
    resource.setrlimit(resource.RLIMIT_FSIZE, (2**30, resource.RLIM_INFINITY))
    conn.send(("ready",))
    for index in range(first, len(jobs)):
        conn.send(("start", index))
        started = time.perf_counter()
        verdict = _run_job(fabric, jobs[index], expected, Path(scratch) / f"job-{index}")
        conn.send(("done", index, dataclasses.replace(verdict, seconds=time.perf_counter() - started)))
    conn.close()


def _wrap_policy() -> set:
    from tests.tests_fabric.helpers.models import Block

    return {Block}


def _run_job(fabric: Any, job: Job, expected: dict, scratch: Path) -> Verdict:
    from lightning_fsdp import CheckpointLoadError
    from lightning_fsdp.loading.convert import convert_checkpoint, describe_checkpoint

    try:
        if job.entry == "_crash":
            os.kill(os.getpid(), signal.SIGSEGV)
        elif job.entry == "_hang":
            time.sleep(3600)
        elif job.entry == "_raise":
            raise ValueError("raised on purpose")
        if job.entry == "inspect":
            describe_checkpoint(job.path)
            return Verdict(True, "described")
        if job.entry == "load":
            return _load_and_compare(fabric, job.path, expected, "")
        convert_checkpoint(job.path, scratch)
        return _load_and_compare(fabric, str(scratch), expected, "the converted checkpoint: ")
    except CheckpointLoadError:
        return Verdict(True, "refused")
    except KeyboardInterrupt:
        raise
    except BaseException as error:  # torch's CheckpointException is a BaseException
        return Verdict(False, f"raised {_error_summary(error)}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _load_and_compare(fabric: Any, path: str, expected: dict, what: str) -> Verdict:
    import torch

    from lightning_fsdp import CheckpointLoadError
    from tests.tests_fabric.helpers.models import TinyTransformer
    from tests.tests_fabric.helpers.state import gather_full_state

    model = fabric.setup_module(TinyTransformer())
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.fill_(_SENTINEL)
    try:
        fabric.load(path, {"model": model})
    except CheckpointLoadError:
        return Verdict(True, "refused")
    except KeyboardInterrupt:
        raise
    except BaseException as error:
        return Verdict(False, f"{what}load raised {_error_summary(error)}")
    loaded = gather_full_state(model)["model"]
    different = [
        name
        for name, tensor in expected.items()
        if name not in loaded
        or loaded[name].dtype != tensor.dtype
        or loaded[name].shape != tensor.shape
        or not torch.equal(loaded[name], tensor)
    ]
    if different:
        shown = ", ".join(different[:4]) + (f", ... ({len(different)} in all)" if len(different) > 4 else "")
        return Verdict(False, f"{what}loaded different values, without an error: {shown}")
    return Verdict(True, "loaded")


def _error_summary(error: BaseException) -> str:
    """The error's type, first line and innermost frame: enough to find it, short enough to list hundreds."""
    text = str(error).strip().splitlines()
    frames = traceback.extract_tb(error.__traceback__)
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:  # torch's CheckpointException: its text is a traceback
        inner = next(iter(failures.values()))[0]
        return f"{type(error).__name__} wrapping {_error_summary(inner)}"
    message = text[0][:200] if text else ""
    return f"{type(error).__name__}: {message}{where}"
