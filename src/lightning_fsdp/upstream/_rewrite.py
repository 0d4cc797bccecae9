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
"""Rewriting this project's names (``lightning_fsdp...``, ``tests.tests_fabric...``) into upstream's.

Imports are rewritten statement by statement from the syntax tree, references in code token by token, and names in
strings, comments and reStructuredText by a pattern. A reference in code that has no upstream destination is an error;
one in prose is reported, for the maintainer to edit. The names that the package keeps for itself (an environment
variable, store keys, thread names, its copyright line) become upstream's by :data:`UPSTREAM_NAMES`, and the parts of
the guide that describe the package itself are left out (:func:`drop_package_only_blocks`).
"""

import ast
import re
import tokenize
from dataclasses import dataclass, field

from lightning_fsdp.upstream._source import Edit, Source, UpstreamError, apply_edits, indentation

_ROOTS = ("lightning_fsdp", "tests.tests_fabric")
_PATTERN = re.compile(r"(?<![\w.])(?:lightning_fsdp|tests\.tests_fabric)(?:\.\w+)*(?!\w)")
_PACKAGE_ONLY = "package_only"
#: A comment that marks a file which is not a test module (a script) as meaningful only for the package.
PACKAGE_ONLY_COMMENT = "# lightning-fsdp: package-only"
#: The lines of a guide page between these two comments describe the package itself (installing it, ``enable()``, its
#: command): the command leaves them out.
PACKAGE_ONLY_START = ".. package-only"
PACKAGE_ONLY_END = ".. end package-only"
#: The names that the package keeps for itself where upstream has a convention of its own, with upstream's spelling:
#: its copyright line, its environment variables (Lightning's are ``PL_*``: ``PL_GLOBAL_SEED``,
#: ``PL_DEEPSPEED_CONFIG_PATH``), the namespace of the loader's keys in the process group's store, and its threads'
#: names. They are rewritten wherever the command carries them: strings, comments, docstrings and the guide.
UPSTREAM_NAMES = {
    "Copyright The lightning-fsdp developers.": "Copyright The Lightning AI team.",
    "LIGHTNING_FSDP_PROGRESS": "PL_CHECKPOINT_LOADING_PROGRESS",
    "LIGHTNING_FSDP_FUZZ_SEED": "PL_CHECKPOINT_LOADING_FUZZ_SEED",
    "LIGHTNING_FSDP_ERRORS_ON_EVERY_RANK": "PL_CHECKPOINT_LOADING_ERRORS_ON_EVERY_RANK",
    "lightning_fsdp/agreement": "lightning/checkpoint_loading/agreement",
    "lightning_fsdp-heartbeat": "lightning-checkpoint-loading-heartbeat",
    "lightning-fsdp-fetch": "lightning-checkpoint-loading-fetch",
}
_UPSTREAM_NAME = re.compile("|".join(rf"(?<![\w-]){re.escape(ours)}(?![\w-])" for ours in UPSTREAM_NAMES))
#: The package's name, which nothing that the command writes should contain.
PACKAGE_NAME = re.compile(r"lightning[_-]fsdp", re.IGNORECASE)
_RST_LABEL = re.compile(r"^\.\. _([^:`]+):\s*$")
_RST_ADORNMENT = re.compile(r"^([=*~^#+\-])\1+\s*$")
_RST_REFERENCES = (
    re.compile(r":ref:`(?:[^`<]*<)?([^`<>]+)>?`"),  # :ref:`label` and :ref:`text <label>`
    re.compile(r"`[^`<]*<([^`<>]+)_>`_"),  # `text <label_>`_
    re.compile(r"(?<![:`])`([^`<]+)`_(?!_)"),  # `Section title`_
)


@dataclass
class NameMap:
    """Where this project's modules and public names live upstream.

    Args:
        modules: Our module (dotted, e.g. ``lightning_fsdp.loading``) to its upstream module; submodules follow.
        exports: A public name of ours (e.g. ``lightning_fsdp.FSDPStrategy``) to its full upstream name.
        known_modules: Every module of ours (dotted), to tell a module from a name inside one.

    """

    modules: dict[str, str]
    exports: dict[str, str]
    known_modules: set[str] = field(default_factory=set)

    def map(self, dotted: str) -> str | None:
        """The upstream name of ``dotted`` (a module, or a name inside one), or ``None`` if it has none."""
        for table in (self.exports, self.modules):
            for ours in sorted(table, key=len, reverse=True):
                if dotted == ours or (dotted.startswith(ours + ".") and ours != "lightning_fsdp"):
                    return table[ours] + dotted[len(ours) :]
        return None

    def module_of(self, dotted: str) -> str | None:
        """The upstream module that must be imported for a reference ``dotted`` (our package's name first)."""
        parts = dotted.split(".")
        for end in range(len(parts), 0, -1):
            head = ".".join(parts[:end])
            if head in self.exports and end > 1:
                return self.exports[head].rsplit(".", 1)[0]
            if head in self.known_modules:
                return self.map(head)
        return None


@dataclass
class Rewritten:
    text: str
    notes: list[str] = field(default_factory=list)


def is_ours(dotted: str) -> bool:
    return any(dotted == root or dotted.startswith(root + ".") for root in _ROOTS)


def rewrite_prose(text: str, names: NameMap, where: str) -> Rewritten:
    """Rewrite our dotted names in free text; those without a destination are listed in the notes."""
    notes: list[str] = []

    def replace(match: re.Match) -> str:
        mapped = names.map(match.group(0))
        if mapped is None:
            line = text.count("\n", 0, match.start()) + 1
            notes.append(f"{where}:{line}: `{match.group(0)}` has no upstream destination")
            return match.group(0)
        return mapped

    renamed = _UPSTREAM_NAME.sub(lambda match: UPSTREAM_NAMES[match.group(0)], text)
    return Rewritten(_PATTERN.sub(replace, renamed), notes)


def package_mentions(text: str) -> list[int]:
    """The numbers of the lines of ``text`` that name the package."""
    return [number for number, line in enumerate(text.splitlines(), 1) if PACKAGE_NAME.search(line)]


def drop_package_only_blocks(text: str, where: str) -> tuple[str, set[str]]:
    """A guide page without its package-only blocks, and the targets (labels, section titles) that they held.

    The blank lines after a block go with it, so that the page keeps the spacing that came before the block.

    """
    kept: list[str] = []
    dropped: list[str] = []
    start: int | None = None
    after_block = False
    for number, line in enumerate(text.splitlines(keepends=True), 1):
        marker = line.strip()
        if marker == PACKAGE_ONLY_START:
            if start is not None:
                raise UpstreamError(f"{where}:{number}: `{marker}` inside the package-only block of line {start}.")
            start = number
        elif marker == PACKAGE_ONLY_END:
            if start is None:
                raise UpstreamError(f"{where}:{number}: `{marker}` without a `{PACKAGE_ONLY_START}` before it.")
            start, after_block = None, True
        elif start is not None:
            dropped.append(line)
        elif not (after_block and not marker):
            after_block = False
            kept.append(line)
    if start is not None:
        raise UpstreamError(f"{where}:{start}: `{PACKAGE_ONLY_START}` is not closed by `{PACKAGE_ONLY_END}`.")
    return "".join(kept), rst_targets("".join(dropped))


def rst_targets(text: str) -> set[str]:
    """The explicit labels and the section titles of a reStructuredText text, normalised as references name them."""
    lines = text.splitlines()
    targets = {_normalized_target(match.group(1)) for line in lines if (match := _RST_LABEL.match(line))}
    for index, line in enumerate(lines[:-1]):
        underline = lines[index + 1].rstrip()
        if line.strip() and _RST_ADORNMENT.match(underline) and len(underline) >= len(line.rstrip()):
            targets.add(_normalized_target(line))
    return targets


def rst_references(text: str) -> set[str]:
    """The labels and section titles that a reStructuredText text refers to, normalised."""
    return {_normalized_target(match.group(1)) for pattern in _RST_REFERENCES for match in pattern.finditer(text)}


def _normalized_target(name: str) -> str:
    return " ".join(name.split()).lower()


def is_package_only(node: ast.stmt) -> bool:
    decorators = getattr(node, "decorator_list", [])
    return any(_PACKAGE_ONLY in ast.unparse(decorator) for decorator in decorators)


def module_is_package_only(text: str) -> bool:
    """A test module marked ``pytestmark = pytest.mark.package_only`` or any file with the package-only comment."""
    if PACKAGE_ONLY_COMMENT in text:
        return True
    for node in ast.parse(text).body:
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(target, ast.Name) and target.id == "pytestmark" for target in node.targets)
            and _PACKAGE_ONLY in ast.unparse(node.value)
        ):
            return True
    return False


def drop_package_only(text: str, name: str) -> tuple[str, int]:
    """Remove the top-level tests marked ``package_only`` (decorators and trailing blank lines included)."""
    source = Source(text, name)
    edits = []
    for node in source.tree.body:
        if is_package_only(node):
            start, end = source.block(node)
            assert node.end_lineno is not None
            line = node.end_lineno
            while line < len(source.lines) and not source.lines[line].strip():
                line += 1
                end = source.line_start(line + 1) if line < len(source.lines) else len(text)
            edits.append(Edit(start, end, ""))
    return apply_edits(text, edits), len(edits)


def rewrite_python(text: str, names: NameMap, name: str) -> Rewritten:
    """Rewrite imports and references to our modules in a Python file; fail on a reference without a destination."""
    source = Source(text, name)
    edits: list[Edit] = []
    notes: list[str] = []
    import_spans: list[tuple[int, int]] = []
    bare_imports: list[ast.Import] = []
    for node in ast.walk(source.tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and is_ours(node.module):
            import_spans.append(source.span(node))
            edits.append(Edit(*source.span(node), _rewrite_import_from(node, source, names)))
        elif isinstance(node, ast.Import) and any(is_ours(alias.name) for alias in node.names):
            import_spans.append(source.span(node))
            if any(alias.asname is None and is_ours(alias.name) for alias in node.names):
                bare_imports.append(node)
            else:
                edits.append(Edit(*source.span(node), _rewrite_import(node, source, names)))
    referenced_modules: list[str] = []
    tokens = list(source.tokens())
    index = 0
    while index < len(tokens):
        token, start, end = tokens[index]
        if any(span[0] <= start < span[1] for span in import_spans):
            index += 1
            continue
        if token.type in (tokenize.STRING, tokenize.COMMENT):
            rewritten = rewrite_prose(token.string, names, f"{name}:{token.start[0]}")
            if rewritten.text != token.string:
                edits.append(Edit(start, end, rewritten.text))
            notes.extend(rewritten.notes)
        elif (
            token.type == tokenize.NAME
            and token.string in ("lightning_fsdp", "tests")
            and not _after_dot(tokens, index)
        ):
            chain, last = _dotted_chain(tokens, index)
            if is_ours(chain):
                mapped = names.map(chain)
                module = names.module_of(chain)
                if mapped is None or module is None:
                    raise UpstreamError(
                        f"{name}:{token.start[0]}: `{chain}` has no upstream destination. Mark the test that uses it"
                        " `@pytest.mark.package_only`, or give it a destination in `lightning_fsdp.upstream`."
                    )
                referenced_modules.append(module)
                edits.append(Edit(start, tokens[last][2], mapped))
                index = last
        index += 1
    for node in bare_imports:
        edits.append(Edit(*source.span(node), _rewrite_bare_import(node, source, names, referenced_modules)))
    return Rewritten(apply_edits(text, edits), notes)


def _after_dot(tokens: list, index: int) -> bool:
    return index > 0 and tokens[index - 1][0].string == "."


def _dotted_chain(tokens: list, index: int) -> tuple[str, int]:
    parts, last = [tokens[index][0].string], index
    while (
        last + 2 < len(tokens)
        and tokens[last + 1][0].string == "."
        and tokens[last + 2][0].type == tokenize.NAME
        and tokens[last + 1][1] == tokens[last][2]
        and tokens[last + 2][1] == tokens[last + 1][2]
    ):
        parts.append(tokens[last + 2][0].string)
        last += 2
    return ".".join(parts), last


def _statements(lines: list[str], source: Source, node: ast.stmt) -> str:
    indent = indentation(source.lines[node.lineno - 1])
    return ("\n" + indent).join(lines)


def _rewrite_import_from(node: ast.ImportFrom, source: Source, names: NameMap) -> str:
    assert node.module is not None
    groups: dict[str, list[str]] = {}
    for alias in node.names:
        mapped = names.map(f"{node.module}.{alias.name}")
        if mapped is None:
            if _is_referenced(source, alias.asname or alias.name, node):
                raise UpstreamError(
                    f"{source.name}:{node.lineno}: `{node.module}.{alias.name}` has no upstream destination. Mark the"
                    " tests that use it `@pytest.mark.package_only`, or give it a destination in"
                    " `lightning_fsdp.upstream`."
                )
            continue
        module, attribute = mapped.rsplit(".", 1)
        bound = alias.asname or alias.name
        groups.setdefault(module, []).append(attribute if bound == attribute else f"{attribute} as {bound}")
    return _statements([import_from_text(module, bound) for module, bound in groups.items()], source, node) or "pass"


def import_from_text(module: str, names: list[str], indent: str = "", width: int = 120) -> str:
    line = f"{indent}from {module} import {', '.join(names)}"
    if len(line) <= width:
        return line
    inner = "".join(f"{indent}    {name},\n" for name in names)
    return f"{indent}from {module} import (\n{inner}{indent})"


def _rewrite_import(node: ast.Import, source: Source, names: NameMap) -> str:
    lines = []
    for alias in node.names:
        target = names.map(alias.name) if is_ours(alias.name) else alias.name
        if target is None:
            raise UpstreamError(f"{source.name}:{node.lineno}: `import {alias.name}` has no upstream destination.")
        lines.append(f"import {target}" + (f" as {alias.asname}" if alias.asname else ""))
    return _statements(lines, source, node)


def _rewrite_bare_import(node: ast.Import, source: Source, names: NameMap, modules: list[str]) -> str:
    lines = [f"import {alias.name}" for alias in node.names if not is_ours(alias.name)]
    lines += [f"import {module}" for module in dict.fromkeys(modules)]
    lines += [
        f"import {names.map(alias.name)} as {alias.asname}"
        for alias in node.names
        if alias.asname and is_ours(alias.name)
    ]
    return _statements(lines, source, node) or "pass"


def _is_referenced(source: Source, bound: str, import_node: ast.stmt) -> bool:
    return any(
        isinstance(node, ast.Name) and node.id == bound for node in ast.walk(source.tree) if node is not import_node
    )
