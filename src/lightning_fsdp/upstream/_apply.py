# Copyright The lightning-fsdp developers.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""What goes where in a Lightning source tree, the check that the tree is the supported release, and the writing."""

import ast
import difflib
import hashlib
import importlib
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

import lightning_fsdp
from lightning_fsdp.upstream._merge import drop_unused_imports, merge_module, upstream_base
from lightning_fsdp.upstream._pinned import PINNED_MASTER_COMMIT, PINNED_MASTER_DEFINITIONS
from lightning_fsdp.upstream._rewrite import (
    NameMap,
    drop_package_only,
    drop_package_only_blocks,
    module_is_package_only,
    package_mentions,
    rewrite_prose,
    rewrite_python,
    rst_references,
    rst_targets,
)
from lightning_fsdp.upstream._source import Edit, Source, UpstreamError, apply_edits, docstring_node, indentation

PACKAGE_DIR = Path(lightning_fsdp.__file__).parent
#: This project's checkout, where the tests and the docs are (absent when the package was installed from a wheel).
PROJECT_DIR = PACKAGE_DIR.parent.parent

#: Where the loading package goes: beside ``utilities/load.py``, as a package of its own.
LOADING_MODULE = "lightning.fabric.utilities.checkpoint_loading"
#: Our modules that are merged, module-level only, into an upstream module (the device checks are not FSDP-specific).
MERGED_MODULES = {
    "devices": "lightning.fabric.strategies.parallel",
    # What both strategies do around the loader; ``model_parallel.py`` imports from ``fsdp.py`` already.
    "loading_calls": "lightning.fabric.strategies.fsdp",
}
#: Our modules that do not go upstream, and why.
NOT_CARRIED = {
    "__init__": "the package's public names; upstream exports them from their new modules",
    "__about__": "the package's version; upstream pins its own requirements",
    "_versions": "the import-time version check; upstream pins its own requirements",
    "opt_in": "`lightning_fsdp.enable()`: once the strategy is upstream, unmodified scripts get it",
    "cli": "the `lightning-fsdp` command: a maintainer would add `inspect` and `convert` to `fabric`'s CLI by hand",
    "upstream": "this command",
    "saving": "the gather-free full save (#28): an extension, to be proposed upstream later as one PR per strategy",
}
#: Where this project's ``tests/tests_fabric/`` goes (its own conftest and helpers come along).
TESTS_DIR = "tests/tests_fabric/utilities/checkpoint_loading"
TESTS_MODULE = "tests_fabric.utilities.checkpoint_loading"
#: Where the guide's pages go, beside ``checkpoint.rst`` and ``distributed_checkpoint.rst``; its examples below.
GUIDE_DIR = "docs/source-fabric/guide/checkpoint"
EXAMPLES_DIR = "docs/source-fabric/guide/checkpoint/examples"
CHANGELOG = "src/lightning/fabric/CHANGELOG.md"
CONNECTOR_MODULE = "lightning.fabric.connector"
CONNECTOR = "src/lightning/fabric/connector.py"
#: The entries this change adds to ``src/lightning/fabric/CHANGELOG.md``, by section.
CHANGELOG_ENTRIES = {
    "Added": [
        "Added support for loading raw module state dicts, safetensors files and Hugging Face sharded checkpoints with"
        " `FSDPStrategy.load_checkpoint` (`fabric.load`, `fabric.load_raw`), shard-locally: each rank reads only the"
        " bytes of its own shard, checked against the file's own structure",
        "Added the `load_concurrency` and `load_progress` arguments to `FSDPStrategy`",
        "Added shard-local loading of the optimizer states of a full checkpoint to `FSDPStrategy.load_checkpoint`:"
        " each rank reads only its own slices of every per-parameter state (Adam's `exp_avg`, SGD's `momentum_buffer`)",
        "Added support for running `FSDPStrategy` on CPU with the `gloo` backend",
        "Added shard-local loading of full and raw checkpoints to `ModelParallelStrategy.load_checkpoint` (FSDP2,"
        " HSDP, tensor parallelism and FSDP x tensor parallelism): each rank copies its own slices into its `DTensor`"
        " shards, with no broadcast",
        "Added support for loading checkpoints into `transformers` models that declare weight conversions (fused"
        " Mixture-of-Experts weights) with `FSDPStrategy` and `ModelParallelStrategy`: each rank reads only its pieces"
        " of the checkpoint's expert tensors",
    ],
    "Changed": [
        "Changed `FSDPStrategy.load_checkpoint` and `ModelParallelStrategy.load_checkpoint` to read a checkpoint file"
        " in remote storage (an fsspec URL) by byte ranges, each rank fetching only its own slices, instead of whole on"
        " every rank, with `weights_only=True` unless `weights_only=False` is passed;"
        " `load_options(storage_options=...)` passes the file system's options, and a remote sharded checkpoint is"
        " read by the same validated reader as a local one",
    ],
    "Fixed": [
        "Fixed `FSDPStrategy` and `ModelParallelStrategy` putting tensors of every rank on `cuda:0` when the cluster"
        " environment is inconsistent; they now refuse with an error that names the values they read",
        "Fixed `ModelParallelStrategy` leaving tensors of modules without `reset_parameters()` (RMSNorm weights, RoPE's"
        " `inv_freq`) uninitialised after `fabric.init_module(empty_init=True)`: the model's own initialisation runs"
        " on each rank's shards",
        "Fixed `FSDPStrategy` failing to set up a model created with `fabric.init_module(empty_init=True)` whose"
        " modules lack `reset_parameters()` (RMSNorm, rotary embeddings, Hugging Face models): the model's own"
        " initialisation runs on each unit as FSDP materialises it",
        "Fixed `FSDPStrategy.load_checkpoint` and `ModelParallelStrategy.load_checkpoint` running code from the pickles"
        " of a sharded checkpoint (`.metadata`, non-tensor entries) whatever `weights_only` says: they are unpickled"
        " weights-only unless `weights_only=False` is passed, and the checkpoint is checked against the model before"
        " anything is read",
    ],
}
_LITERALINCLUDE = re.compile(r"^(\s*\.\. literalinclude:: )(\S+)", re.MULTILINE)


@dataclass
class Change:
    """One file the command writes, relative to the tree's root, with its old and new text."""

    path: str
    old: str | None
    new: str
    source: str  # what in this project it comes from

    def counts(self) -> tuple[int, int]:
        added = removed = 0
        for line in difflib.unified_diff((self.old or "").splitlines(), self.new.splitlines(), lineterm="", n=0):
            if line.startswith("+") and not line.startswith("+++"):
                added += 1
            elif line.startswith("-") and not line.startswith("---"):
                removed += 1
        return added, removed


@dataclass
class Plan:
    """Everything the command would write, and what it leaves for a maintainer."""

    root: Path
    found_version: str
    changes: list[Change] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """A ``git diff --stat`` style summary."""
        rows = [(change.path, *change.counts()) for change in sorted(self.changes, key=lambda change: change.path)]
        width = max((len(path) for path, _, _ in rows), default=0)
        total_added = sum(added for _, added, _ in rows)
        total_removed = sum(removed for _, _, removed in rows)
        largest = max((added + removed for _, added, removed in rows), default=1) or 1
        scale = min(1.0, 60 / largest)
        lines = []
        for path, added, removed in rows:
            bar = "+" * max(int(added * scale), 1 if added else 0) + "-" * max(
                int(removed * scale), 1 if removed else 0
            )
            lines.append(f" {path:<{width}} | {added + removed:>5} {bar}")
        lines.append(
            f" {len(rows)} files changed, {total_added} insertions(+), {total_removed} deletions(-)"
            f" (into lightning {self.found_version} at {self.root})"
        )
        return "\n".join(lines)

    def write(self) -> None:
        for change in self.changes:
            path = self.root / change.path
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(change.new)


def find_root(tree: Path) -> Path:
    """The root of a Lightning checkout or sdist (holding ``src/lightning/fabric``), given it or its ``src/``."""
    for candidate in (tree, tree.parent if tree.name == "src" else None):
        if candidate is not None and (candidate / "src" / "lightning" / "fabric" / "strategies" / "fsdp.py").is_file():
            return candidate
    raise UpstreamError(
        f"{tree} is not a Lightning source tree: `src/lightning/fabric/strategies/fsdp.py` is missing. Pass the root of"
        " a git checkout of Lightning-AI/pytorch-lightning or of an unpacked sdist"
        " (`pip download --no-binary :all: --no-deps lightning==X.Y.Z`)."
    )


def tree_version(root: Path) -> str:
    for candidate in ("src/version.info", "src/lightning/version.info"):
        if (root / candidate).is_file():
            return (root / candidate).read_text().strip()
    return "of unknown version"


#: A part of the change, as the numbered series cuts it: given a file of this project (relative to its checkout) and
#: its text, the text restricted to that part (``None``: the file is not part of it). ``CHANGELOG.md`` gets one entry
#: at a time and the connector ``"connector"``: any text kept keeps them.
Restriction = Callable[[str, str], str | None]


def _everything(path: str, text: str) -> str | None:
    return text


def plan(tree: Path, restrict: Restriction = _everything) -> Plan:
    """Compute every file the command writes into ``tree``; raise :class:`UpstreamError` before writing anything.

    ``restrict`` keeps a part of the change (one step of the series and those before it); by default, all of it.

    """
    root = find_root(tree)
    result = Plan(root, tree_version(root))
    ours = _our_modules()
    targets = _targets(ours)
    from_master = _check_supported(root, result.found_version, _relevant_definitions(ours, targets))
    if from_master:
        result.notes.append(
            f"the tree is Lightning's master at {PINNED_MASTER_COMMIT} in the definitions that the change replaces or"
            f" calls and that differ from lightning {version('lightning')}'s: {'; '.join(from_master)}"
        )
    names = _name_map(root, ours, targets)
    # Module-level merges first, so that a class merged into the same module finds their helpers there.
    merged: dict[str, Change] = {}
    for name in sorted(targets, key=lambda name: (name not in MERGED_MODULES, name)):
        text = restrict(_ours_path(ours[name]), ours[name].read_text())
        if text is None:
            continue
        path = _module_path(targets[name])
        if path not in merged:
            original = _read(root / path)
            merged[path] = Change(path, original, original, name)
        else:
            merged[path].source += f", {name}"
        rewritten = rewrite_python(text, names, _ours_path(ours[name]))
        result.notes.extend(rewritten.notes)
        ours_source = Source(rewritten.text, _ours_path(ours[name]))
        merged[path].new = merge_module(Source(merged[path].new, path), targets[name], ours_source)
    for change in merged.values():
        change.new = drop_unused_imports(change.old or "", change.new, change.path)
    result.changes.extend(merged.values())
    loading_dir = PACKAGE_DIR / "loading"
    cycle = set(targets.values())
    for file in sorted(loading_dir.rglob("*.py")):
        relative = file.relative_to(loading_dir).as_posix()
        kept = restrict(_ours_path(file), file.read_text())
        if kept is None:
            continue
        rewritten = rewrite_python(kept, names, _ours_path(file))
        result.notes.extend(rewritten.notes)
        text = _localize_imports(Source(rewritten.text, relative), cycle)
        path = f"{_module_path(LOADING_MODULE, package=True)}/{relative}"
        result.changes.append(Change(path, _read_optional(root / path), text, _ours_path(file)))
    connector = _read(root / CONNECTOR)
    if restrict("connector", "connector") is not None:
        allowed = drop_unused_imports(connector, _allow_cpu(Source(connector, CONNECTOR)), CONNECTOR)
        result.changes.append(Change(CONNECTOR, connector, allowed, "strategy (CPU)"))
    entries = {
        section: [entry for entry in section_entries if restrict("CHANGELOG.md", entry) is not None]
        for section, section_entries in CHANGELOG_ENTRIES.items()
    }
    if any(entries.values()):
        changelog = _read(root / CHANGELOG)
        result.changes.append(
            Change(CHANGELOG, changelog, _changelog(changelog, {k: v for k, v in entries.items() if v}), "CHANGELOG.md")
        )
    _carry_tests(root, names, result, restrict)
    _carry_docs(root, names, result, restrict)
    result.notes.extend(f"not carried: src/lightning_fsdp/{name}: {why}" for name, why in _not_carried(ours).items())
    for change in result.changes:
        mentions = package_mentions(change.new)
        if mentions:
            result.notes.append(f"{change.path}: names the package on lines {', '.join(map(str, mentions))}")
    return result


def _our_modules() -> dict[str, Path]:
    """Our top-level modules (``strategy``, ``devices``, ...) outside the loading package."""
    modules = {path.stem: path for path in PACKAGE_DIR.glob("*.py")}
    modules.update({path.name: path for path in PACKAGE_DIR.iterdir() if (path / "__init__.py").is_file()})
    return modules


def _targets(ours: dict[str, Path]) -> dict[str, str]:
    """Each of our modules that is merged into an upstream module, with that module."""
    targets = {}
    for name, path in ours.items():
        if name in NOT_CARRIED or name == "loading":
            continue
        if name in MERGED_MODULES:
            targets[name] = MERGED_MODULES[name]
            continue
        base = upstream_base(path.read_text(), _ours_path(path)) if path.is_file() else None
        if base is None:
            raise UpstreamError(
                f"`{_ours_path(path)}` has no upstream destination: it neither subclasses an upstream class nor is"
                " listed in `lightning_fsdp.upstream._apply` (`MERGED_MODULES`, `NOT_CARRIED`). Add it there, and"
                " to the map in docs/source-fabric/upstream.rst."
            )
        targets[name] = base[0]
    return targets


def _not_carried(ours: dict[str, Path]) -> dict[str, str]:
    return {
        f"{name}.py" if ours[name].is_file() else f"{name}/": why for name, why in NOT_CARRIED.items() if name in ours
    }


def _module_path(module: str, package: bool = False) -> str:
    return "src/" + module.replace(".", "/") + ("" if package else ".py")


def _ours_path(path: Path) -> str:
    return path.relative_to(PACKAGE_DIR.parent.parent).as_posix() if path.is_relative_to(PROJECT_DIR) else str(path)


def _read(path: Path) -> str:
    if not path.is_file():
        raise UpstreamError(f"{path} is missing: the tree does not look like the supported Lightning release.")
    return path.read_text()


def _read_optional(path: Path) -> str | None:
    return path.read_text() if path.is_file() else None


def _name_map(root: Path, ours: dict[str, Path], targets: dict[str, str]) -> NameMap:
    modules = {f"lightning_fsdp.{name}": module for name, module in targets.items()}
    modules["lightning_fsdp.loading"] = LOADING_MODULE
    modules["tests.tests_fabric"] = TESTS_MODULE
    exported_by_strategies = {
        alias.asname or alias.name
        for node in ast.parse(_read(root / "src/lightning/fabric/strategies/__init__.py")).body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    exports: dict[str, str] = {}
    # The package's public names are imported on first use; their imports for type checkers say where each lives.
    for node in ast.walk(ast.parse((PACKAGE_DIR / "__init__.py").read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_fsdp."):
            for alias in node.names:
                exported = alias.asname or alias.name
                name = node.module.split(".")[1]
                if (
                    name in targets
                    and upstream_base(ours[name].read_text(), name)
                    and exported in exported_by_strategies
                ):
                    exports[f"lightning_fsdp.{exported}"] = f"lightning.fabric.strategies.{exported}"
                elif any(node.module == ours_ or node.module.startswith(ours_ + ".") for ours_ in modules):
                    mapped = NameMap(modules, {}).map(f"{node.module}.{alias.name}")
                    if mapped is not None:
                        exports[f"lightning_fsdp.{exported}"] = mapped
    if "strategy" in targets:
        exports["lightning_fsdp"] = targets["strategy"]
    known = {
        f"lightning_fsdp.{path.relative_to(PACKAGE_DIR).with_suffix('').as_posix().replace('/', '.')}"
        for path in PACKAGE_DIR.rglob("*.py")
    }
    known = {name.removesuffix(".__init__") for name in known} | {"lightning_fsdp"}
    tests_dir = PROJECT_DIR / "tests" / "tests_fabric"
    if tests_dir.is_dir():
        known |= {
            "tests.tests_fabric." + path.relative_to(tests_dir).with_suffix("").as_posix().replace("/", ".")
            for path in tests_dir.rglob("*.py")
        }
        known = {name.removesuffix(".__init__") for name in known} | {"tests.tests_fabric"}
    return NameMap(modules, exports, known)


def _definitions(text: str) -> dict[str, str]:
    """Each top-level statement and class member of a module, keyed by name, as a normalised syntax tree."""
    definitions = {}
    for node in ast.parse(text).body:
        if isinstance(node, ast.ClassDef):
            definitions[f"class {node.name}"] = _normalized(ast.ClassDef(**{**node.__dict__, "body": []}))
            for member in node.body:
                key = member.name if isinstance(member, ast.FunctionDef) else ast.unparse(member)[:60]
                definitions[f"{node.name}.{key}"] = definitions.get(f"{node.name}.{key}", "") + _normalized(member)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            definitions[node.name] = _normalized(node)
        else:
            definitions[ast.unparse(node).splitlines()[0][:80]] = _normalized(node)
    return definitions


def _normalized(value: Any) -> str:
    """A syntax tree as text, without positions and without empty fields.

    Newer Pythons add empty fields (``type_params``): without them, a fingerprint is the same on every Python.

    """
    if isinstance(value, ast.AST):
        fields = (f"{name}={_normalized(child)}" for name, child in ast.iter_fields(value) if child not in (None, []))
        return f"{type(value).__name__}({', '.join(fields)})"
    if isinstance(value, list):
        return f"[{', '.join(_normalized(item) for item in value)}]"
    return repr(value)


def _fingerprint(definition: str | None) -> str:
    """A short hash of a normalised definition; empty for a definition that the module does not have."""
    return hashlib.sha256(definition.encode()).hexdigest()[:16] if definition is not None else ""


def pinned_fingerprints(tree: Path) -> dict[str, dict[str, str]]:
    """Fingerprints of the definitions that the change replaces or calls and that differ in ``tree`` from the release.

    For master at the pinned commit, they are what ``_pinned.PINNED_MASTER_DEFINITIONS`` holds.

    """
    root = find_root(Path(tree))
    ours = _our_modules()
    fingerprints: dict[str, dict[str, str]] = {}
    for module, keys in sorted(_relevant_definitions(ours, _targets(ours)).items()):
        expected, actual = _reference_definitions(module), _definitions(_read(root / _module_path(module)))
        changed = {key: _fingerprint(actual.get(key)) for key in sorted(keys) if expected.get(key) != actual.get(key)}
        if changed:
            fingerprints[module] = changed
    return fingerprints


def _reference_definitions(module: str) -> dict[str, str]:
    """The definitions of ``module`` in the installed release."""
    return _definitions(Path(importlib.import_module(module).__file__ or "").read_text())


def _relevant_definitions(ours: dict[str, Path], targets: dict[str, str]) -> dict[str, set[str]]:
    """Per upstream module that the command edits, the definitions that the change replaces, merges into or calls.

    Those must be the ones it was written and tested against; the others may differ. They are (keys of
    :func:`_definitions`): each upstream class that one of ours is merged into (its header, the methods ours defines
    and those ours calls through ``super()``), the module-level names that a merged module of ours defines (they
    would collide), every name that our modules and the loading package import from those upstream modules or read
    as attributes of them, and the connector's method that loses its GPU-only check.

    """
    relevant: dict[str, set[str]] = {module: set() for module in {*targets.values(), CONNECTOR_MODULE}}
    relevant[CONNECTOR_MODULE].add("_Connector._check_strategy_and_fallback")
    files = [(name, path) for name, path in sorted(ours.items()) if name in targets and path.is_file()]
    files += [(None, path) for path in sorted((PACKAGE_DIR / "loading").rglob("*.py"))]
    for name, file in files:
        text = file.read_text()
        tree = ast.parse(text)
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    if f"{node.module}.{alias.name}" in relevant:
                        aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                    elif node.module in relevant:
                        relevant[node.module].add(alias.name)
            elif isinstance(node, ast.Import):
                aliases.update({alias.asname: alias.name for alias in node.names if alias.asname in relevant})
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                relevant[aliases[node.value.id]].add(node.attr)
        if name in MERGED_MODULES:
            relevant[targets[name]] |= {
                node.name for node in tree.body if isinstance(node, ast.FunctionDef | ast.ClassDef)
            }
        base = upstream_base(text, _ours_path(file)) if name is not None else None
        if base is not None:
            module, cls = base
            ours_class = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == cls)
            relevant[module].add(f"class {cls}")
            relevant[module] |= {f"{cls}.{node.name}" for node in ours_class.body if isinstance(node, ast.FunctionDef)}
            relevant[module] |= {
                f"{cls}.{node.func.attr}"
                for node in ast.walk(ours_class)
                if isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Call)
                and isinstance(node.func.value.func, ast.Name)
                and node.func.value.func.id == "super"
            }
    return relevant


def _check_supported(root: Path, found: str, relevant: dict[str, set[str]]) -> list[str]:
    """Refuse a tree in which a definition that the change replaces or calls differs from the installed release's.

    A definition that is master's at the pinned commit is accepted; those are returned.

    """
    installed = version("lightning")
    differences = []
    from_master = []
    for module, keys in sorted(relevant.items()):
        path = _module_path(module)
        expected, actual = _reference_definitions(module), _definitions(_read(root / path))
        changed = sorted(key for key in keys if expected.get(key) != actual.get(key))
        pinned = PINNED_MASTER_DEFINITIONS.get(module, {})
        unknown = [key for key in changed if pinned.get(key) != _fingerprint(actual.get(key))]
        from_master += [f"{path}: `{key}`" for key in changed if key not in unknown]
        if unknown:
            shown = ", ".join(f"`{key}`" for key in unknown[:12]) + (
                f" and {len(unknown) - 12} more" if len(unknown) > 12 else ""
            )
            differences.append(f"  - {path}: {shown}")
    if differences:
        raise UpstreamError(
            f"{root} does not look like lightning {installed}, the release this package supports and is installed here,"
            f" nor like Lightning's master at {PINNED_MASTER_COMMIT}: it holds lightning {found} (says its"
            f" version.info), and these definitions, which the change replaces or calls, differ from both:\n"
            + "\n".join(differences)
            + f"\nApply the command to the sources of lightning {installed} (its git tag, or"
            f" `pip download --no-binary :all: --no-deps lightning=={installed}`) or to master at"
            f" {PINNED_MASTER_COMMIT}. docs/source-fabric/upstream.rst says how the pinned commit is moved."
        )
    return from_master


def _localize_imports(source: Source, modules: set[str]) -> str:
    """Move top-level imports from the modules we merge into into the functions that use them.

    Those modules import the loading package, so a top-level import back would be a cycle; Lightning imports inside
    functions in that case too.

    """
    edits = []
    localized: dict[str, str] = {}
    for node in source.tree.body:
        if isinstance(node, ast.ImportFrom) and node.module in modules:
            edits.append(Edit(*source.block(node), ""))
            localized.update({alias.asname or alias.name: node.module for alias in node.names})
    if not localized:
        return source.text
    functions = [node for node in source.tree.body if isinstance(node, ast.FunctionDef)]
    functions += [
        member
        for node in source.tree.body
        if isinstance(node, ast.ClassDef)
        for member in node.body
        if isinstance(member, ast.FunctionDef)
    ]
    covered: set[int] = set()
    for function in functions:
        used = {node.id for statement in function.body for node in ast.walk(statement) if isinstance(node, ast.Name)}
        covered |= {id(node) for statement in function.body for node in ast.walk(statement)}
        needed: dict[str, list[str]] = {}
        for name in sorted(used & localized.keys()):
            needed.setdefault(localized[name], []).append(name)
        if needed:
            first = function.body[1] if docstring_node(function.body) and len(function.body) > 1 else function.body[0]
            indent = indentation(source.lines[first.lineno - 1])
            lines = "".join(f"{indent}from {module} import {', '.join(names)}\n" for module, names in needed.items())
            edits.append(Edit(source.block(first)[0], source.block(first)[0], lines + "\n"))
    for node in ast.walk(source.tree):
        if isinstance(node, ast.Name) and node.id in localized and id(node) not in covered:
            raise UpstreamError(
                f"{source.name}:{node.lineno}: `{node.id}` is imported from `{localized[node.id]}`, which imports this"
                " module upstream, and used outside a function body: import it inside the functions that use it."
            )
    return apply_edits(source.text, edits)


def _allow_cpu(connector: Source) -> str:
    """Remove the connector's check that refuses ``FSDPStrategy`` without a GPU."""
    for node in ast.walk(connector.tree):
        if isinstance(node, ast.If) and len(node.body) == 1 and isinstance(node.body[0], ast.Raise) and not node.orelse:
            message = " ".join(
                value.value
                for value in ast.walk(node.body[0])
                if isinstance(value, ast.Constant) and isinstance(value.value, str)
            )
            if "FSDP" in message and "GPU" in message and "FSDPStrategy" in ast.unparse(node.test):
                return apply_edits(connector.text, [Edit(*connector.block(node), "")])
    raise UpstreamError(
        f"{connector.name}: the check that refuses `FSDPStrategy` without a GPU was not found, so the tree does not"
        " look like the supported release."
    )


def _changelog(text: str, entries_by_section: dict[str, list[str]] = CHANGELOG_ENTRIES) -> str:
    """Our entries under the unreleased section, each in its subsection (created when missing)."""
    lines = text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if re.match(r"## \[unreleased\]", line, re.IGNORECASE)), None)
    if start is None:
        first = next((i for i, line in enumerate(lines) if line.startswith("## ")), len(lines))
        lines[first:first] = ["## [unreleased] - YYYY-MM-DD\n", "\n"]
        start = first
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    for section, entries in entries_by_section.items():
        text_entries = [f"- {entry}\n" for entry in entries]
        heading = next((i for i in range(start, end) if lines[i].strip() == f"### {section}"), None)
        if heading is None:
            lines[end:end] = [f"### {section}\n", "\n", *(line for entry in text_entries for line in (entry, "\n"))]
            end += 2 + 2 * len(text_entries)
            continue
        position = heading + 1
        while position < end and not lines[position].strip():
            position += 1
        if position < end and lines[position].strip() == "-":
            del lines[position]
            end -= 1
        block = [line for entry in text_entries for line in ("\n", entry)][1:]
        if position < end and lines[position].strip():
            block.append("\n")
        lines[position:position] = block
        end += len(block)
    return "".join(lines)


def _carry_tests(root: Path, names: NameMap, result: Plan, restrict: Restriction = _everything) -> None:
    ours = PROJECT_DIR / "tests" / "tests_fabric"
    if not ours.is_dir():
        result.notes.append("tests not carried: this package was not run from a checkout of lightning-fsdp")
        return
    if not (root / "tests" / "tests_fabric").is_dir():
        result.notes.append(f"tests not carried: {root} has no tests/tests_fabric/ (an sdist has none)")
        return
    dropped = 0
    for file in sorted(path for path in ours.rglob("*") if path.is_file() and "__pycache__" not in path.parts):
        relative = file.relative_to(ours).as_posix()
        destination = f"{TESTS_DIR}/{relative}"
        if file.suffix != ".py":
            kept = restrict(f"tests/tests_fabric/{relative}", file.read_text())
            if kept is not None:
                result.changes.append(Change(destination, _read_optional(root / destination), kept, relative))
            continue
        text = file.read_text()
        if module_is_package_only(text):
            result.notes.append(f"not carried: tests/tests_fabric/{relative} (package-only)")
            continue
        kept = restrict(f"tests/tests_fabric/{relative}", text)
        if kept is None:
            continue
        text, count = drop_package_only(kept, relative)
        dropped += count
        rewritten = rewrite_python(text, names, f"tests/tests_fabric/{relative}")
        result.notes.extend(rewritten.notes)
        result.changes.append(Change(destination, _read_optional(root / destination), rewritten.text, relative))
    result.notes.append(f"not carried: {dropped} tests marked `package_only` in the carried test files")


def _carry_docs(root: Path, names: NameMap, result: Plan, restrict: Restriction = _everything) -> None:
    docs = PROJECT_DIR / "docs" / "source-fabric"
    if not docs.is_dir():
        result.notes.append("docs not carried: this package was not run from a checkout of lightning-fsdp")
        return
    if not (root / "docs" / "source-fabric").is_dir():
        result.notes.append(f"docs not carried: {root} has no docs/source-fabric/ (an sdist has none)")
        return
    carried_examples: dict[Path, str] = {}
    for example in sorted((docs / "examples").glob("*.py")):
        text = example.read_text()
        if module_is_package_only(text) or "lightning_fsdp.enable" in text:
            result.notes.append(f"not carried: docs/source-fabric/examples/{example.name} (package-only)")
            continue
        destination = f"{EXAMPLES_DIR}/{example.name}"
        kept = restrict(f"docs/source-fabric/examples/{example.name}", text)
        if kept is None:
            continue
        text = kept
        try:
            rewritten = rewrite_python(text, names, f"docs/source-fabric/examples/{example.name}")
        except UpstreamError as error:
            result.notes.append(f"not carried: docs/source-fabric/examples/{example.name} ({error})")
            continue
        carried_examples[example.resolve()] = destination
        result.changes.append(Change(destination, _read_optional(root / destination), rewritten.text, example.name))
    pages = {
        page: drop_package_only_blocks(page.read_text(), _ours_path(page)) for page in sorted(docs.glob("guide/*.rst"))
    }
    _check_package_only_references(pages)
    for page in pages:
        destination = f"{GUIDE_DIR}/{page.name}"
        where = f"docs/source-fabric/guide/{page.name}"
        restricted = restrict(where, page.read_text())
        if restricted is None:
            continue
        kept, _ = drop_package_only_blocks(restricted, _ours_path(page))
        rewritten = rewrite_prose(kept, names, where)
        text = _relink_includes(rewritten.text, page, destination, carried_examples, result, where)
        result.notes.extend(rewritten.notes)
        result.changes.append(Change(destination, _read_optional(root / destination), text, where))


def _check_package_only_references(pages: dict[Path, tuple[str, set[str]]]) -> None:
    """Refuse a guide whose carried text refers to a label or a section that only the package's docs have."""
    kept_targets = set().union(*(rst_targets(kept) for kept, _ in pages.values()))
    package_only = set().union(*(dropped for _, dropped in pages.values())) - kept_targets
    broken = [
        f"{_ours_path(page)}: `{target}`"
        for page, (kept, _) in pages.items()
        for target in sorted(rst_references(kept) & package_only)
    ]
    if broken:
        raise UpstreamError(
            "the guide refers, outside its package-only blocks, to sections inside them, which upstream's guide would"
            " not have:\n" + "\n".join(f"  - {reference}" for reference in broken) + "\nMove the reference into the"
            " block, or the section out of it."
        )


def _relink_includes(
    text: str, page: Path, destination: str, examples: dict[Path, str], result: Plan, where: str
) -> str:
    def replace(match: re.Match) -> str:
        included = (page.parent / match.group(2)).resolve()
        if included not in examples:
            line = text.count("\n", 0, match.start()) + 1
            result.notes.append(f"{where}:{line}: includes {match.group(2)}, which is not carried")
            return match.group(0)
        relative = os.path.relpath(examples[included], os.path.dirname(destination))
        return match.group(1) + Path(relative).as_posix()

    return _LITERALINCLUDE.sub(replace, text)


def destinations() -> dict[str, str]:
    """Map this project's source paths to where the command writes them (the table in upstream.rst)."""
    ours = _our_modules()
    table = {}
    for name, path in sorted(ours.items()):
        relative = f"src/lightning_fsdp/{path.name}" + ("/" if path.is_dir() else "")
        if name in NOT_CARRIED:
            table[relative] = "not carried"
        elif name == "loading":
            table[relative] = _module_path(LOADING_MODULE, package=True) + "/"
        elif name in MERGED_MODULES:
            table[relative] = _module_path(MERGED_MODULES[name])
        else:
            base = upstream_base(path.read_text(), name)
            table[relative] = _module_path(base[0]) if base else "no destination"
    table["tests/tests_fabric/"] = TESTS_DIR + "/"
    table["docs/source-fabric/guide/"] = GUIDE_DIR + "/"
    table["docs/source-fabric/examples/"] = EXAMPLES_DIR + "/"
    table["CHANGELOG.md"] = CHANGELOG
    return table
