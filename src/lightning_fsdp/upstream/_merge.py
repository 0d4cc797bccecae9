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
"""Merging one of our modules into an upstream module: imports, module-level helpers, and a subclass into its base.

A subclass ``class FSDPStrategy(_UpstreamFSDPStrategy)`` is merged into upstream's class of the same module:

- ``__init__``: our new parameters join upstream's signature (keyword-only, before ``**kwargs``), our statements
  before and after ``super().__init__(...)`` go before and after upstream's body, and the parameters' descriptions
  join the class docstring's arguments;
- every other method of ours replaces upstream's method of the same name; where ours calls ``super().<name>(...)``,
  upstream's method is kept beside it as ``_default_<name>`` and called as ``self._default_<name>(...)``;
- new methods and class attributes are appended to the class.

Module-level functions, classes and constants are appended to the module, and their imports join upstream's. Names
that our module imported from the upstream module itself become plain references.
"""

import ast
import importlib
from dataclasses import dataclass

from lightning_fsdp.upstream._rewrite import import_from_text
from lightning_fsdp.upstream._source import (
    Edit,
    Source,
    UpstreamError,
    apply_edits,
    bound_names,
    docstring_node,
    indentation,
    is_type_checking_block,
    reindent,
)

_DEFAULT_PREFIX = "_default_"


@dataclass(frozen=True)
class _Binding:
    module: str
    name: str | None  # None for ``import module``

    def text(self, bound: str) -> str:
        if self.name is None:
            return f"import {self.module}" + ("" if bound == self.module.split(".")[0] else f" as {bound}")
        return f"from {self.module} import {self.name}" + ("" if bound == self.name else f" as {bound}")


def upstream_base(text: str, name: str) -> tuple[str, str] | None:
    """The upstream ``(module, class)`` that the first class of our module subclasses, if it is upstream's."""
    source = Source(text, name)
    bindings = _bindings(source.tree.body)
    for node in source.tree.body:
        if isinstance(node, ast.ClassDef) and len(node.bases) == 1 and isinstance(node.bases[0], ast.Name):
            binding = bindings.get(node.bases[0].id)
            if binding is None or binding.name is None or not binding.module.startswith("lightning."):
                continue
            cls = getattr(importlib.import_module(binding.module), binding.name, None)
            if isinstance(cls, type) and cls.__module__.startswith("lightning.") and cls.__name__ == node.name:
                return cls.__module__, cls.__name__
    return None


def merge_module(target: Source, target_module: str, ours: Source) -> str:
    """Merge ``ours`` (imports already rewritten to upstream's names) into ``target``; return the new text."""
    ours = _resolve_self_references(ours, target_module)
    target_bindings = _bindings(target.tree.body)
    target_type_checking = _bindings(
        [statement for node in target.tree.body if is_type_checking_block(node) for statement in node.body]  # type: ignore[attr-defined]
    )
    target_defined = {name for node in target.tree.body for name in bound_names(node)}
    classes = {node.name: node for node in target.tree.body if isinstance(node, ast.ClassDef)}
    same_as_upstream = {ast.dump(node) for node in target.tree.body}
    edits: list[Edit] = []
    new_imports: dict[str, list[str]] = {}
    new_type_checking: dict[str, list[str]] = {}
    appended: list[str] = []
    for node in ours.tree.body:
        if node is docstring_node(ours.tree.body):
            continue
        if isinstance(node, ast.Import | ast.ImportFrom) or is_type_checking_block(node):
            statements = node.body if is_type_checking_block(node) else [node]  # type: ignore[attr-defined]
            for bound, binding in _bindings(statements).items():
                itself = binding.module == target_module or f"{binding.module}.{binding.name}" == target_module
                if itself or (binding.name is not None and _is_base_class(binding, ours)):
                    continue
                existing = target_bindings.get(bound)
                if existing == binding or (existing is not None and _same_object(existing, binding)):
                    continue
                checked = target_type_checking.get(bound)
                if checked is not None and (checked == binding or _same_object(checked, binding)):
                    if is_type_checking_block(node):
                        continue
                    # Upstream imports it for type checking only; our code needs it at run time too.
                elif existing is not None or bound in target_defined:
                    raise UpstreamError(
                        f"{ours.name} binds `{bound}` as `{binding.text(bound)}`, but {target.name} already defines"
                        f" `{bound}` otherwise: rename it in {ours.name}."
                    )
                table = new_type_checking if is_type_checking_block(node) else new_imports
                if binding.name is None:
                    table.setdefault("", []).append(binding.text(bound))
                else:
                    table.setdefault(binding.module, []).append(
                        binding.name if bound == binding.name else f"{binding.name} as {bound}"
                    )
                target_bindings[bound] = binding
        elif isinstance(node, ast.ClassDef) and node.name in classes and _subclasses_upstream(node, ours):
            edits.extend(_merge_class(target, classes[node.name], ours, node))
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Assign | ast.AnnAssign):
            if ast.dump(node) in same_as_upstream:
                continue  # e.g. a ``TypeVar`` that repeats upstream's
            for bound in bound_names(node):
                if bound in target_defined:
                    raise UpstreamError(
                        f"{ours.name} defines `{bound}`, which {target.name} already defines: rename it in {ours.name}."
                    )
            appended.append(ours.block_text(node))
        else:
            raise UpstreamError(f"{ours.name}:{node.lineno}: cannot merge this module-level statement into upstream.")
    edits.extend(_import_edits(target, new_imports, new_type_checking))
    if appended:
        edits.append(Edit(len(target.text), len(target.text), "".join(f"\n\n{block}" for block in appended)))
    return apply_edits(target.text, edits)


def _same_object(first: _Binding, second: _Binding) -> bool:
    """Whether two imports bind the same object (``ClusterEnvironment`` from its module or from its package)."""
    if {first.module, second.module} == {"typing", "collections.abc"} and first.name == second.name:
        return True  # the same generic alias for annotations; upstream's spelling is kept
    try:
        objects = [
            importlib.import_module(binding.module)
            if binding.name is None
            else getattr(importlib.import_module(binding.module), binding.name)
            for binding in (first, second)
        ]
    except (ImportError, AttributeError):
        return False
    return objects[0] is objects[1]


def _bindings(statements: list[ast.stmt]) -> dict[str, _Binding]:
    bindings = {}
    for node in statements:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                bindings[alias.asname or alias.name] = _Binding(node.module, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                bindings[alias.asname or alias.name.split(".")[0]] = _Binding(alias.name, None)
    return bindings


def _is_base_class(binding: _Binding | None, ours: Source) -> bool:
    """Whether ``binding`` imports the upstream class that a class of ours extends under the same name."""
    bound = _bindings(ours.tree.body)
    return binding is not None and any(
        isinstance(base, ast.Name) and bound.get(base.id) == binding and binding.name == node.name
        for node in ours.tree.body
        if isinstance(node, ast.ClassDef)
        for base in node.bases
    )


def _subclasses_upstream(node: ast.ClassDef, ours: Source) -> bool:
    bindings = _bindings(ours.tree.body)
    return any(isinstance(base, ast.Name) and _is_base_class(bindings.get(base.id), ours) for base in node.bases)


def _resolve_self_references(ours: Source, target_module: str) -> Source:
    """``alias.name`` where ``alias`` is the upstream module itself becomes ``name``; ``super()`` calls are resolved."""
    edits = []
    aliases = {
        bound
        for bound, binding in _bindings(ours.tree.body).items()
        if (binding.name is None and binding.module == target_module)
        or (binding.name is not None and f"{binding.module}.{binding.name}" == target_module)
    }
    for node in ast.walk(ours.tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            edits.append(Edit(*ours.span(node), node.attr))
    return Source(apply_edits(ours.text, edits), ours.name)


def _super_calls(function: ast.FunctionDef) -> list[ast.Attribute]:
    return [
        node
        for node in ast.walk(function)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Name)
        and node.value.func.id == "super"
        and not node.value.args
    ]


def _merge_class(target: Source, upstream: ast.ClassDef, ours: Source, subclass: ast.ClassDef) -> list[Edit]:
    methods: dict[str, list[ast.FunctionDef]] = {}
    for node in upstream.body:
        if isinstance(node, ast.FunctionDef):
            methods.setdefault(node.name, []).append(node)
    overridden = {node.name for node in subclass.body if isinstance(node, ast.FunctionDef)}
    edits: list[Edit] = []
    appended: list[str] = []
    for node in subclass.body:
        if node is docstring_node(subclass.body):
            continue
        if isinstance(node, ast.FunctionDef) and node.name == "__init__":
            (upstream_init,) = methods["__init__"]
            edits.extend(_merge_init(target, upstream, upstream_init, ours, subclass, node))
            continue
        if not isinstance(node, ast.FunctionDef):
            appended.append(ours.block_text(node))
            continue
        kept, text = _resolve_super(ours, node, methods, overridden)
        if node.name not in methods:
            appended.append(text)
            continue
        if len(methods[node.name]) > 1:
            raise UpstreamError(
                f"{ours.name}: `{subclass.name}.{node.name}` overrides a property with a setter upstream; merge it by"
                " hand."
            )
        (original,) = methods[node.name]
        if kept:
            text += "\n" + _renamed(target, original)
        edits.append(Edit(*target.block(original), text))
    if appended:
        end = target.block(upstream)[1]
        edits.append(Edit(end, end, "".join(f"\n{block}" for block in appended)))
    return edits


def _resolve_super(
    ours: Source, function: ast.FunctionDef, methods: dict[str, list[ast.FunctionDef]], overridden: set[str]
) -> tuple[bool, str]:
    """Our method's text with ``super().name`` resolved; whether upstream's method must be kept as ``_default_``."""
    start, end = ours.block(function)
    edits, kept = [], False
    for node in _super_calls(function):
        if node.attr not in methods:
            continue  # inherited by upstream's class too: ``super()`` still means the same method
        if node.attr == function.name:
            kept = True
            replacement = f"self.{_DEFAULT_PREFIX}{node.attr}"
        elif node.attr in overridden:
            raise UpstreamError(
                f"{ours.name}:{node.lineno}: `super().{node.attr}` inside `{function.name}` calls upstream's"
                f" `{node.attr}`, which this project replaces: call it from `{node.attr}` itself."
            )
        else:
            replacement = f"self.{node.attr}"
        node_start, node_end = ours.span(node)
        edits.append(Edit(node_start - start, node_end - start, replacement))
    return kept, apply_edits(ours.text[start:end], edits)


def _renamed(target: Source, method: ast.FunctionDef) -> str:
    lines = target.block_text(method).splitlines(keepends=True)
    out = []
    for line in lines:
        if line.strip() == "@override":
            continue
        out.append(line.replace(f"def {method.name}(", f"def {_DEFAULT_PREFIX}{method.name}(", 1))
    return "".join(out)


def _merge_init(
    target: Source,
    upstream: ast.ClassDef,
    upstream_init: ast.FunctionDef,
    ours: Source,
    subclass: ast.ClassDef,
    init: ast.FunctionDef,
) -> list[Edit]:
    upstream_args = upstream_init.args
    upstream_names = [arg.arg for arg in [*upstream_args.posonlyargs, *upstream_args.args, *upstream_args.kwonlyargs]]
    ours_args = init.args
    defaults = dict(
        zip(
            [arg.arg for arg in [*ours_args.posonlyargs, *ours_args.args]][::-1],
            ours_args.defaults[::-1],
            strict=False,
        )
    )
    defaults.update(
        {arg.arg: default for arg, default in zip(ours_args.kwonlyargs, ours_args.kw_defaults, strict=True) if default}
    )
    new = [arg for arg in [*ours_args.args, *ours_args.kwonlyargs] if arg.arg not in [*upstream_names, "self"]]
    calls = [
        (index, statement)
        for index, statement in enumerate(init.body)
        if isinstance(statement, ast.Expr)
        and isinstance(statement.value, ast.Call)
        and any(node.attr == "__init__" for node in _super_calls(statement))  # type: ignore[arg-type]
    ]
    if len(calls) != 1:
        raise UpstreamError(f"{ours.name}: `{subclass.name}.__init__` must call `super().__init__(...)` once.")
    index, call_statement = calls[0]
    call = call_statement.value
    assert isinstance(call, ast.Call)
    assignments = _argument_assignments(ours, call, init, upstream_init)
    body_start = 1 if docstring_node(init.body) else 0
    ours_indent = indentation(ours.lines[init.body[-1].lineno - 1])
    target_indent = indentation(target.lines[upstream_init.body[-1].lineno - 1])

    def statements(nodes: list[ast.stmt]) -> str:
        return "".join(reindent(ours.block_text(node), ours_indent, target_indent) for node in nodes)

    before = "".join(f"{target_indent}{line}\n" for line in assignments) + statements(init.body[body_start:index])
    after = statements(init.body[index + 1 :])
    edits = []
    if new:
        edits.append(_signature_edit(target, upstream_init, ours, new, defaults))
    upstream_body_start = 1 if docstring_node(upstream_init.body) else 0
    if before:
        first = upstream_init.body[upstream_body_start]
        edits.append(Edit(target.block(first)[0], target.block(first)[0], before))
    if after:
        end = target.block(upstream_init.body[-1])[1]
        edits.append(Edit(end, end, after))
    docstring = _docstring_edit(target, upstream, ours, subclass, [arg.arg for arg in new])
    if docstring is not None:
        edits.append(docstring)
    return edits


def _argument_assignments(
    ours: Source, call: ast.Call, init: ast.FunctionDef, upstream_init: ast.FunctionDef
) -> list[str]:
    """Statements that bind upstream's parameters to what our ``super().__init__(...)`` passes, where it differs."""
    positional = [arg.arg for arg in [*upstream_init.args.posonlyargs, *upstream_init.args.args][1:]]
    assignments = []
    for position, value in enumerate(call.args):
        if isinstance(value, ast.Starred):
            if not (isinstance(value.value, ast.Name) and init.args.vararg and value.value.id == init.args.vararg.arg):
                raise UpstreamError(f"{ours.name}:{call.lineno}: cannot merge `super().__init__(*...)`.")
            continue
        name = positional[position]
        if not (isinstance(value, ast.Name) and value.id == name):
            assignments.append(f"{name} = {ours.segment(value)}")
    for keyword in call.keywords:
        if keyword.arg is None:
            if not (
                isinstance(keyword.value, ast.Name) and init.args.kwarg and keyword.value.id == init.args.kwarg.arg
            ):
                raise UpstreamError(f"{ours.name}:{call.lineno}: cannot merge `super().__init__(**...)`.")
            continue
        if not (isinstance(keyword.value, ast.Name) and keyword.value.id == keyword.arg):
            assignments.append(f"{keyword.arg} = {ours.segment(keyword.value)}")
    return assignments


def _signature_edit(
    target: Source, upstream_init: ast.FunctionDef, ours: Source, new: list[ast.arg], defaults: dict[str, ast.expr]
) -> Edit:
    kwarg = upstream_init.args.kwarg
    star = not upstream_init.args.vararg and not upstream_init.args.kwonlyargs
    parameters = (["*"] if star else []) + [
        ours.segment(arg) + (f" = {ours.segment(defaults[arg.arg])}" if arg.arg in defaults else "") for arg in new
    ]
    if kwarg is None:
        return _append_parameters(target, upstream_init, parameters)
    line = target.lines[kwarg.lineno - 1]
    if line.strip().startswith("**"):
        indent = indentation(line)
        position = target.line_start(kwarg.lineno)
        return Edit(position, position, "".join(f"{indent}{parameter},\n" for parameter in parameters))
    position = target.offset(kwarg.lineno, kwarg.col_offset) - 2
    return Edit(position, position, "".join(f"{parameter}, " for parameter in parameters))


def _append_parameters(target: Source, upstream_init: ast.FunctionDef, parameters: list[str]) -> Edit:
    """Add parameters after the last one of a signature without ``**kwargs``."""
    args = upstream_init.args
    nodes: list[ast.AST] = [*args.posonlyargs, *args.args, *args.defaults, *args.kwonlyargs]
    nodes += [default for default in args.kw_defaults if default is not None]
    last = max(nodes, key=lambda node: (node.end_lineno, node.end_col_offset))  # type: ignore[attr-defined]
    end = target.offset(last.end_lineno, last.end_col_offset)  # type: ignore[attr-defined]
    line = target.lines[last.end_lineno - 1]  # type: ignore[attr-defined]
    if line.rstrip().endswith(","):
        indent = indentation(line)
        position = target.line_start(last.end_lineno + 1)  # type: ignore[attr-defined]
        return Edit(position, position, "".join(f"{indent}{parameter},\n" for parameter in parameters))
    return Edit(end, end, "".join(f", {parameter}" for parameter in parameters))


def _docstring_edit(
    target: Source, upstream: ast.ClassDef, ours: Source, subclass: ast.ClassDef, names: list[str]
) -> Edit | None:
    """Insert our description of the new arguments into the class docstring, before ``**kwargs`` or at the end."""
    ours_doc, upstream_doc = docstring_node(subclass.body), docstring_node(upstream.body)
    if ours_doc is None or upstream_doc is None or not names:
        return None
    described = []
    lines = ours.lines[ours_doc.lineno - 1 : ours_doc.end_lineno]
    for name in names:
        for position, line in enumerate(lines):
            if line.strip().startswith(f"{name}:"):
                indent = indentation(line)
                block = [line]
                for following in lines[position + 1 :]:
                    if following.strip() and len(indentation(following)) <= len(indent):
                        break
                    block.append(following)
                while block and not block[-1].strip():
                    block.pop()
                described.append((indent, "".join(block)))
                break
    if not described:
        return None
    upstream_lines = target.lines[upstream_doc.lineno - 1 : upstream_doc.end_lineno]
    for position, line in enumerate(upstream_lines):
        if line.strip().startswith(("\\**kwargs:", "**kwargs:")):
            indent = indentation(line)
            offset = target.line_start(upstream_doc.lineno + position)
            text = "".join(reindent(block, old, indent) for old, block in described)
            blank = "\n" if position > 0 and not upstream_lines[position - 1].strip() else ""
            return Edit(offset, offset, text + blank)
    return None


def _import_edits(target: Source, imports: dict[str, list[str]], type_checking: dict[str, list[str]]) -> list[Edit]:
    edits = []
    header = [
        node
        for node in _leading(target.tree.body)
        if isinstance(node, ast.Import | ast.ImportFrom) and node is not docstring_node(target.tree.body)
    ]
    if imports:
        end = target.block(header[-1])[1]
        edits.append(Edit(end, end, _import_lines(imports, "")))
    if type_checking:
        block = next((node for node in target.tree.body if is_type_checking_block(node)), None)
        if block is None:
            end = target.block(header[-1])[1]
            edits.append(Edit(end, end, "\nif TYPE_CHECKING:\n" + _import_lines(type_checking, "    ")))
        else:
            end = target.block(block)[1]
            edits.append(Edit(end, end, _import_lines(type_checking, "    ")))
    return edits


def _leading(body: list[ast.stmt]) -> list[ast.stmt]:
    leading = []
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom) or node is docstring_node(body):
            leading.append(node)
        else:
            break
    return leading


def _import_lines(imports: dict[str, list[str]], indent: str) -> str:
    lines = [f"{indent}{statement}\n" for statement in imports.get("", [])]
    lines += [f"{import_from_text(module, names, indent)}\n" for module, names in imports.items() if module]
    return "".join(lines)


def drop_unused_imports(original: str, text: str, name: str) -> str:
    """Remove the names that upstream imported and used, and that the change left unused (what ruff's F401 reports).

    Imports that upstream did not use either (re-exports) and statements with comments are left alone.

    """
    before, after = _used_names(original), _used_names(text)
    source = Source(text, name)
    statements = [*source.tree.body]
    statements += [child for node in source.tree.body if is_type_checking_block(node) for child in node.body]  # type: ignore[attr-defined]
    edits = []
    for node in statements:
        if not isinstance(node, ast.ImportFrom) or not node.module or "#" in source.block_text(node):
            continue
        unused = [alias for alias in node.names if (alias.asname or alias.name) in before - after and alias.name != "*"]
        if not unused:
            continue
        kept = [
            alias.name if alias.asname is None else f"{alias.name} as {alias.asname}"
            for alias in node.names
            if alias not in unused
        ]
        indent = indentation(source.lines[node.lineno - 1])
        replacement = f"{import_from_text(node.module, kept, indent)}\n" if kept else ""
        edits.append(Edit(*source.block(node), replacement))
    return apply_edits(text, edits)


def _used_names(text: str) -> set[str]:
    """Names read anywhere in a module, including inside string annotations."""
    tree = ast.parse(text)
    used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and len(node.value) < 200:
            try:
                annotation = ast.parse(node.value, mode="eval")
            except SyntaxError:
                continue
            used |= {child.id for child in ast.walk(annotation) if isinstance(child, ast.Name)}
    return used
