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
"""Python sources as text plus their syntax tree: positions of nodes, and edits applied by position."""

import ast
import io
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass


class UpstreamError(RuntimeError):
    """The command cannot write this project's change into the given tree; the message says why and what to do."""


@dataclass(frozen=True)
class Edit:
    """Replace ``text[start:end]`` by ``replacement`` (``start == end`` inserts)."""

    start: int
    end: int
    replacement: str


class Source:
    """A Python file's text with its syntax tree, and conversions from ``ast`` positions to text offsets."""

    def __init__(self, text: str, name: str) -> None:
        self.text = text
        self.name = name
        try:
            self.tree = ast.parse(text)
        except SyntaxError as error:
            raise UpstreamError(f"Cannot parse {name}: {error}") from None
        self.lines = text.splitlines(keepends=True)
        self._line_starts = [0]
        for line in self.lines:
            self._line_starts.append(self._line_starts[-1] + len(line))

    def offset(self, lineno: int, col: int) -> int:
        """The text offset of ``ast``'s (1-based line, UTF-8 byte column)."""
        line = self.lines[lineno - 1] if lineno <= len(self.lines) else ""
        return self._line_starts[lineno - 1] + len(line.encode()[:col].decode(errors="ignore"))

    def line_start(self, lineno: int) -> int:
        return self._line_starts[lineno - 1]

    def first_line(self, node: ast.stmt) -> int:
        """The first line of a statement, its decorators included."""
        decorators = getattr(node, "decorator_list", [])
        return min([node.lineno, *(decorator.lineno for decorator in decorators)])

    def block(self, node: ast.stmt) -> tuple[int, int]:
        """Offsets of the whole lines that a statement spans, decorators included, newline included."""
        assert node.end_lineno is not None
        return self.line_start(self.first_line(node)), self._line_starts[node.end_lineno]

    def block_text(self, node: ast.stmt) -> str:
        start, end = self.block(node)
        return self.text[start:end]

    def segment(self, node: ast.AST) -> str:
        segment = ast.get_source_segment(self.text, node)
        assert segment is not None
        return segment

    def span(self, node: ast.AST) -> tuple[int, int]:
        return (
            self.offset(node.lineno, node.col_offset),  # type: ignore[attr-defined]
            self.offset(node.end_lineno, node.end_col_offset),  # type: ignore[attr-defined]
        )

    def tokens(self) -> Iterator[tuple[tokenize.TokenInfo, int, int]]:
        """Every token with its start and end text offsets."""
        for token in tokenize.generate_tokens(io.StringIO(self.text).readline):
            if token.type == tokenize.ENDMARKER:
                return
            (start_row, start_col), (end_row, end_col) = token.start, token.end
            # tokenize counts columns in characters, not bytes.
            yield token, self._line_starts[start_row - 1] + start_col, self._line_starts[end_row - 1] + end_col


def apply_edits(text: str, edits: list[Edit]) -> str:
    """Apply non-overlapping edits; insertions at the same offset keep their order."""
    ordered = sorted(enumerate(edits), key=lambda item: (item[1].start, item[1].end, item[0]))
    pieces, position = [], 0
    for _, edit in ordered:
        if edit.start < position:
            raise AssertionError(f"overlapping edits at offset {edit.start}")
        pieces.append(text[position : edit.start])
        pieces.append(edit.replacement)
        position = edit.end
    pieces.append(text[position:])
    return "".join(pieces)


def docstring_node(body: list[ast.stmt]) -> ast.stmt | None:
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):  # noqa: SIM102
        if isinstance(body[0].value.value, str):
            return body[0]
    return None


def is_type_checking_block(node: ast.stmt) -> bool:
    return (
        isinstance(node, ast.If)
        and isinstance(node.test, ast.Name)
        and node.test.id == "TYPE_CHECKING"
        and not node.orelse
        and all(isinstance(statement, ast.Import | ast.ImportFrom) for statement in node.body)
    )


def bound_names(node: ast.stmt) -> list[str]:
    """The module-level names a statement binds."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return [node.name]
    if isinstance(node, ast.Import | ast.ImportFrom):
        return [(alias.asname or alias.name).split(".")[0] for alias in node.names]
    if isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return [name.id for target in targets for name in ast.walk(target) if isinstance(name, ast.Name)]
    if is_type_checking_block(node):
        return [name for statement in node.body for name in bound_names(statement)]  # type: ignore[attr-defined]
    return []


def reindent(text: str, old: str, new: str) -> str:
    """Replace the leading ``old`` indentation of every non-blank line by ``new``."""
    out = []
    for line in text.splitlines(keepends=True):
        if line.strip() and line.startswith(old):
            line = new + line[len(old) :]
        out.append(line)
    return "".join(out)


def indentation(line: str) -> str:
    return line[: len(line) - len(line.lstrip())]
