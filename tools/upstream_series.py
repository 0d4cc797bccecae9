"""Place the core (``src/lightning_fsdp/core/``) onto a Lightning source tree, as the pull requests of the manifest.

    python tools/upstream_series.py TREE --series BRANCH   # a clean git checkout of master: one commit per PR
    python tools/upstream_series.py TREE --apply           # any tree (an unpacked sdist too): the changes, no commits

The manifest (``tools/upstream_series.toml``) lists the PRs in merge order. For each PR the tool copies the named
module-level definitions of the core verbatim into their destination module (replacing master's definition of the
same name in place, or appending after the last definition), adds the imports they need, applies the few
statement-level edits of master's methods (located with ``ast``; a missing anchor is an error), carries the named test
functions (with the module-level helpers and fixtures they use) into Lightning's test files, inserts the docs
fragments into Lightning's pages, the ``lines`` into requirements files and the CHANGELOG line under its heading,
then runs ``ruff check --fix --select I,F401`` and ``ruff format`` with the tree's own configuration, and checks the
result with ``ruff check --select F``. It prints the lines each PR changes. ``--only N`` stops after PR N. A tree
without ``tests/`` (an unpacked sdist) gets the source changes, and the CHANGELOG and docs where they exist; its test
edits and carried tests are skipped, and one note says so.
"""

import argparse
import ast
import difflib
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import tomllib

PROJECT = Path(__file__).resolve().parents[1]
#: The checkouts of the package the core is read from, first match wins (``--core``; default: this one).
CORES = [PROJECT]


def core(relative: str) -> Path:
    """The file of the core at ``relative`` (in the first checkout that has it)."""
    return next((root / relative for root in CORES if (root / relative).is_file()), CORES[0] / relative)


MANIFEST = Path(__file__).with_suffix(".toml")
#: An unfilled figure in a description: the PR is not ready to be opened.
PLACEHOLDER = re.compile(r"\[FIGURE: [^\]]*\]")
#: What ``--from-git`` takes from a Lightning repository: the sources, Fabric's tests and docs, the ruff configuration.
FABRIC_PATHS = ("pyproject.toml", "requirements", "src", "tests/tests_fabric", "docs/source-fabric")
DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Assign, ast.AnnAssign)


class SeriesError(Exception):
    """The manifest and the core (or the tree) disagree: what, where, and what to change."""


# --- reading modules ------------------------------------------------------------------------------------------------


def definition_name(node: ast.stmt) -> str | None:
    """The name a module-level definition binds (``None`` for other statements)."""
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
        return node.targets[0].id
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return node.target.id
    return getattr(node, "name", None) if isinstance(node, DEFINITIONS) else None


def definitions(tree: ast.Module) -> dict[str, ast.stmt]:
    """The module-level definitions by name."""
    return {name: node for node in tree.body if (name := definition_name(node))}


def span(node: ast.stmt, lines: list[str]) -> tuple[int, int]:
    """0-based ``[start, stop)`` lines of ``node`` with its decorators and the comment lines right above it."""
    start = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))]) - 1
    while start > 0 and lines[start - 1].strip().startswith("#"):
        start -= 1
    return start, node.end_lineno


def top_level(body: list[ast.stmt], in_type_checking: bool = False):
    """Yield ``(statement, in_type_checking)`` for module-level statements, looking into ``if``/``try`` blocks."""
    for node in body:
        yield node, in_type_checking
        if isinstance(node, ast.If):
            checking = in_type_checking or "TYPE_CHECKING" in ast.unparse(node.test)
            yield from top_level(node.body, checking)
            yield from top_level(node.orelse, in_type_checking)
        elif isinstance(node, ast.Try):
            for block in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                yield from top_level(block, in_type_checking)


def bound_names(tree: ast.Module) -> set[str]:
    """The names a module binds at module level (imports, definitions, assignments)."""
    names = set()
    for node, _ in top_level(tree.body):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif name := definition_name(node):
            names.add(name)
    return names


def imports_by_name(tree: ast.Module) -> dict[str, tuple[str, bool]]:
    """For each name a module imports: the import statement that binds it alone, and whether under TYPE_CHECKING."""
    found = {}
    for node, checking in top_level(tree.body):
        for alias in getattr(node, "names", []) if isinstance(node, (ast.Import, ast.ImportFrom)) else []:
            as_ = f" as {alias.asname}" if alias.asname else ""
            if isinstance(node, ast.ImportFrom):
                statement = f"from {'.' * node.level}{node.module or ''} import {alias.name}{as_}"
            else:
                statement = f"import {alias.name}{as_}"
            found[(alias.asname or alias.name).split(".")[0]] = (statement, checking)
    return found


def names_used(nodes: list[ast.AST]) -> set[str]:
    """Names that ``nodes`` read, including those in string annotations and pytest fixture arguments."""
    used = set()
    for node in (n for root in nodes for n in ast.walk(root)):
        if isinstance(node, ast.Name):
            used.add(node.id)
        elif isinstance(node, ast.arg):
            used.add(node.arg)  # a fixture of the same module, when the function is a test
            annotation = node.annotation
            if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
                used |= names_used([ast.parse(annotation.value, mode="eval")])
        elif isinstance(getattr(node, "returns", None), ast.Constant) and isinstance(node.returns.value, str):
            used |= names_used([ast.parse(node.returns.value, mode="eval")])
    return used


# --- editing a destination file -------------------------------------------------------------------------------------


class Target:
    """A destination file of the tree, edited as text and re-parsed after each change."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.text = path.read_text() if path.exists() else ""

    @property
    def lines(self) -> list[str]:
        return self.text.splitlines(keepends=True)

    @property
    def tree(self) -> ast.Module:
        return ast.parse(self.text)

    def splice(self, start: int, stop: int, new: str) -> None:
        lines = self.lines
        self.text = "".join(lines[:start]) + new + "".join(lines[stop:])

    def place(self, name: str, source: str, after: str | None = None) -> None:
        """Replace the definition ``name`` in place, or add ``source`` after ``after`` (default: at the end)."""
        found = definitions(self.tree)
        if name in found:
            self.splice(*span(found[name], self.lines), source)
        elif after is not None:
            if after not in found:
                raise SeriesError(f"{self.path}: the anchor `{after}` for `{name}` is not defined there")
            stop = found[after].end_lineno
            self.splice(stop, stop, "\n\n" + source)
        else:
            self.text = self.text.rstrip("\n") + ("\n\n\n" if self.text.strip() else "") + source

    def add_imports(self, statements: list[str], type_checking: bool = False) -> None:
        """Add import statements after the module's last import (or in its ``if TYPE_CHECKING:`` block)."""
        if not statements:
            return
        body = self.tree.body
        if type_checking:
            blocks = [n for n in body if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)]
            if not blocks:
                raise SeriesError(f"{self.path}: no `if TYPE_CHECKING:` block for {statements}")
            stop, indent = blocks[0].body[-1].end_lineno, " " * blocks[0].body[0].col_offset
        else:
            imports = [n for n in body if isinstance(n, (ast.Import, ast.ImportFrom))]
            docstring = body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
            stop = imports[-1].end_lineno if imports else (body[0].end_lineno if docstring else 0)
            indent = ""
        self.splice(stop, stop, "".join(f"{indent}{s}\n" for s in statements))

    def edit(self, function: str, statement: str, action: str, code: str) -> None:
        """Replace (or insert before/after) the one statement in ``function`` whose source starts with ``statement``."""
        scope, tree = None, self.tree
        for part in function.split(".") if function else []:
            holder = scope.body if scope else tree.body
            scope = next((n for n in holder if getattr(n, "name", None) == part), None)
            if scope is None:
                raise SeriesError(f"{self.path}: `{function}` not found (no `{part}`): the edit's anchor has moved")
        key = "".join(statement.split())
        lines = self.lines
        matches = [
            node
            for node in ast.walk(scope or tree)
            if isinstance(node, ast.stmt)
            and node is not scope
            and "".join("".join(lines[node.lineno - 1 : node.end_lineno])[node.col_offset :].split()).startswith(key)
        ]
        if len(matches) != 1:
            raise SeriesError(
                f"{self.path}: {len(matches)} statements in `{function or 'the module'}` start with {statement!r};"
                " the edit needs exactly one: update the manifest to master's current code"
            )
        node = matches[0]
        start, stop = span(node, lines)
        indent = lines[node.lineno - 1][: node.col_offset]
        # a blank line that opens or closes the code (after the one TOML drops) is kept
        blank = ("\n" if code.startswith("\n") else "", "\n" if code.endswith("\n\n") else "")
        new = textwrap.indent(textwrap.dedent(code).strip("\n") + "\n", indent).join(blank) if code.strip() else ""
        if action == "before":
            self.splice(start, start, new)
        elif action == "after":
            self.splice(stop, stop, new)
        elif action == "replace":
            self.splice(start, stop, new)
        elif action == "header" and hasattr(node, "body"):
            self.splice(node.lineno - 1, span(node.body[0], lines)[0], new)
        else:
            raise SeriesError(f"unknown edit action {action!r} (replace, header, before, after)")


# --- copying definitions with their imports -------------------------------------------------------------------------


def rewrite(text: str, renames: dict[str, str]) -> str:
    """Replace the package's module paths by their destinations (longest first)."""
    for old in sorted(renames, key=len, reverse=True):
        text = re.sub(rf"\b{re.escape(old)}\b", renames[old], text)
    return text


def rewrite_import(statement: str, renames: dict[str, str]) -> str:
    """``from a.b import C`` with ``a.b.C`` renamed as a whole (a class imported from its package), else by module."""
    match = re.fullmatch(r"from (\S+) import (\w+)(.*)", statement)
    if match and f"{match[1]}.{match[2]}" in renames:
        module, _, name = renames[f"{match[1]}.{match[2]}"].rpartition(".")
        return f"from {module} import {name}{match[3]}"
    return rewrite(statement, renames)


def copy_definitions(
    source: Path, names: list[str], target: Target, renames: dict[str, str], after: str | None = None, closure=False
) -> None:
    """Copy ``names`` (and, with ``closure``, the module-level helpers they use) from ``source`` into ``target``."""
    text = source.read_text()
    tree, lines = ast.parse(text), text.splitlines(keepends=True)
    found = definitions(tree)
    missing = [name for name in names if name not in found]
    if missing:
        raise SeriesError(f"{source} defines no {missing}: update the manifest")
    chosen, queue = [], list(names)
    while queue:
        name = queue.pop(0)
        if name in chosen:
            continue
        chosen.append(name)
        if closure:
            helpers = sorted(n for n in names_used([found[name]]) if n in found and n not in chosen)
            theirs, their_lines = definitions(target.tree), target.lines
            for helper in (h for h in helpers if h in bound_names(target.tree)):
                mine = "".join(lines[slice(*span(found[helper], lines))])
                if helper not in theirs or "".join(their_lines[slice(*span(theirs[helper], their_lines))]) != mine:
                    raise SeriesError(f"`{helper}` of {source.name} differs from the one in {target.path}: rename it")
            queue += [helper for helper in helpers if helper not in theirs]
    # the definitions in the order of the source file, so that helpers keep their place next to their users
    chosen.sort(key=lambda name: found[name].lineno)
    for name in chosen:
        target.place(name, rewrite("".join(lines[slice(*span(found[name], lines))]), renames), after)
        after = name if after is not None else None
    imports, have = imports_by_name(tree), bound_names(target.tree)
    needed = sorted(names_used([found[name] for name in chosen]) - have)
    plain = [rewrite_import(imports[n][0], renames) for n in needed if n in imports and not imports[n][1]]
    checking = [rewrite_import(imports[n][0], renames) for n in needed if n in imports and imports[n][1]]
    own = target_module(target)
    plain = [s for s in plain if not s.startswith(f"from {own} import")]
    target.add_imports(sorted(set(plain)))
    target.add_imports(sorted(set(checking)), type_checking=True)


def target_module(target: Target) -> str:
    """The dotted module name of a destination file (``src/lightning/x.py`` -> ``lightning.x``)."""
    parts = target.path.with_suffix("").parts
    root = max(i for i, p in enumerate(parts) if p in ("src", "tests")) + 1
    return ".".join(parts[root:])


def changelog(text: str, heading: str, line: str) -> str:
    """Add ``line`` as the last entry under ``### heading`` of the unreleased section."""
    match = re.search(r"^## \[unreleased\].*?(?=^## \[|\Z)", text, re.MULTILINE | re.DOTALL | re.IGNORECASE)
    if match is None:
        raise SeriesError("the CHANGELOG has no `## [unreleased]` section")
    section = match.group(0)
    sub = re.search(rf"^### {heading}\n(.*?)(?=^### |^---|\Z)", section, re.MULTILINE | re.DOTALL)
    if sub is None:
        raise SeriesError(f"the unreleased section of the CHANGELOG has no `### {heading}`")
    entries = [entry for entry in sub.group(1).strip().split("\n\n") if entry.strip() not in ("", "-")]
    block = f"### {heading}\n\n" + "\n\n".join([*entries, line.strip()]) + "\n\n"
    section = section[: sub.start()] + block + section[sub.end() :]
    return text[: match.start()] + section + text[match.end() :]


def insert_doc(page: str, fragment: str, before: str | None) -> str:
    """Insert ``fragment`` as a section of ``page``: before the section titled ``before``, or at the end."""
    separator = "\n\n----\n\n\n"
    if before is None:
        return page.rstrip("\n") + separator + fragment.strip("\n") + "\n"
    lines = page.splitlines(keepends=True)
    title = next((i for i, ln in enumerate(lines) if ln.strip() == before and i + 1 < len(lines)), None)
    if title is None or not re.fullmatch(r"([*=\-~^#])\1{3,}", lines[title + 1].strip()):
        raise SeriesError(f"the page has no section titled {before!r}")
    head = title - 1 if re.fullmatch(r"([*=\-~^#])\1{3,}", lines[title - 1].strip()) else title
    start = head
    while start > 0 and lines[start - 1].strip() in ("", "----"):
        start -= 1
    return "".join(lines[:start]).rstrip("\n") + separator + fragment.strip("\n") + separator + "".join(lines[head:])


# --- a PR -----------------------------------------------------------------------------------------------------------


def apply_pr(tree: Path, pr: dict, manifest: dict, config: Path, ruff: str) -> dict[str, Target]:
    """Write one PR into ``tree``; return the files it touched."""
    targets: dict[str, Target] = {}

    def target(relative: str) -> Target:
        return targets.setdefault(relative, Target(tree / relative))

    renames = manifest["renames"]
    # an unpacked sdist has no tests: its test edits and carried tests are skipped (`main` says so once)
    has_tests = (tree / "tests").is_dir()
    for entry in pr.get("definitions", []):
        source = core(entry["core"])
        dest = target(manifest["destinations"][entry["core"]])
        copy_definitions(source, entry["names"], dest, renames, after=entry.get("after"))
    for edit in pr.get("edits", []):
        if not has_tests and edit["file"].startswith("tests/"):
            continue
        dest = target(edit["file"])
        try:
            dest.edit(edit.get("function", ""), edit["statement"], edit.get("action", "replace"), edit.get("code", ""))
        except SeriesError as error:
            if not edit.get("optional"):
                raise
            print(f"  note: optional edit skipped: {error}")
            continue
        dest.add_imports(edit.get("imports", []))
    for entry in pr.get("tests", []) if has_tests else []:
        dest_path = tree / manifest["destinations"][entry["core"]]
        if not dest_path.parent.is_dir():
            print(f"  note: {dest_path.parent} absent, tests of {entry['core']} not carried")
            continue
        dest = target(manifest["destinations"][entry["core"]])
        clash = set(entry["names"]) & set(definitions(dest.tree))
        if clash:
            raise SeriesError(f"{dest.path} already defines {sorted(clash)}: a carried test never replaces master's")
        copy_definitions(core(entry["core"]), entry["names"], dest, renames, closure=True)
    for entry in pr.get("docs", []):
        page = tree / entry["page"]
        if not page.is_file():
            print(f"  note: {entry['page']} absent, docs not inserted")
            continue
        dest = target(entry["page"])
        fragment = (Path(__file__).resolve().parents[1] / entry["fragment"]).read_text()  # beside the tool
        dest.text = insert_doc(dest.text, fragment, entry.get("before"))
    for entry in pr.get("lines", []):
        # a requirement added to a requirements file (appended where the file lacks it)
        page = tree / entry["file"]
        if not page.is_file():
            print(f"  note: {entry['file']} absent, line not added")
            continue
        dest = target(entry["file"])
        if entry["line"] not in dest.text.splitlines():
            dest.text = dest.text.rstrip("\n") + "\n" + entry["line"] + "\n"
    log = tree / manifest["changelog"]
    if "changelog" in pr and log.is_file():
        target(manifest["changelog"]).text = changelog(log.read_text(), *pr["changelog"])
    for relative, dest in targets.items():
        imports = ast.walk(dest.tree) if relative.endswith(".py") else []
        for node in (n for n in imports if isinstance(n, ast.ImportFrom) and n.module and not n.level):
            module = tree / "src" / (node.module.replace(".", "/") + ".py")
            if targets.get(f"src/{node.module.replace('.', '/')}.py") is None and not module.is_file():
                continue
            text = (
                targets[key].text
                if (key := f"src/{node.module.replace('.', '/')}.py") in targets
                else module.read_text()
            )
            if missing := [a.name for a in node.names if a.name not in bound_names(ast.parse(text))]:
                raise SeriesError(
                    f"{relative} imports {missing} from {node.module}, which no PR up to `{pr['key']}` adds"
                )
        if re.search(r"\blightning_fsdp\b|^\s*(from|import) tests\.", dest.text, re.MULTILINE):
            raise SeriesError(f"{relative} still names `lightning_fsdp` or `tests.` after the renames: see `renames`")
        dest.path.parent.mkdir(parents=True, exist_ok=True)
        dest.path.write_text(dest.text)
    python = [str(tree / r) for r in targets if r.endswith(".py")]
    if python:
        run = [ruff, "--config", str(config)]
        subprocess.run([*run[:1], "check", *run[1:], "--fix", "--select", "I,F401", "-q", *python], cwd=tree)
        subprocess.run([*run[:1], "format", *run[1:], "-q", *python], cwd=tree, check=True)
        lint = subprocess.run([*run[:1], "check", *run[1:], "--select", "F,E9", *python], cwd=tree, text=True,
                              capture_output=True)  # fmt: skip
        if lint.returncode:
            raise SeriesError(f"PR `{pr['key']}` leaves errors (an unassigned helper?):\n{lint.stdout}")
    return targets


def numstat(before: dict[str, str], tree: Path) -> dict[str, list[int]]:
    """Lines added and removed per kind (src, tests with the test requirements, docs with the CHANGELOG)."""
    counts = {"src": [0, 0], "tests": [0, 0], "docs": [0, 0]}
    for relative, old in before.items():
        new = (tree / relative).read_text() if (tree / relative).exists() else ""
        kind = "docs" if relative.startswith("docs/") or relative.endswith("CHANGELOG.md") else relative.split("/")[0]
        kind = "tests" if kind == "requirements" else kind
        for line in difflib.unified_diff(old.splitlines(), new.splitlines(), lineterm="", n=0):
            if line[:1] in "+-" and line[:3] not in ("+++", "---"):
                counts[kind][line[0] == "-"] += 1
    return counts


def files_of(pr: dict, manifest: dict) -> set[str]:
    """The tree's files a PR may touch."""
    destinations = manifest["destinations"]
    files = {destinations[e["core"]] for e in pr.get("definitions", []) + pr.get("tests", [])}
    files |= {e["file"] for e in pr.get("edits", []) + pr.get("lines", [])} | {e["page"] for e in pr.get("docs", [])}
    return files | {manifest["changelog"]} if "changelog" in pr else files


def check_assignment(manifest: dict) -> list[str]:
    """Each core definition in exactly one PR: the duplicates are errors, the unassigned ones are returned."""
    seen: dict[tuple[str, str], str] = {}
    for pr in manifest["pr"]:
        for entry in pr.get("definitions", []) + pr.get("tests", []):
            for name in entry["names"]:
                if (entry["core"], name) in seen:
                    first = seen[entry["core"], name]
                    raise SeriesError(f"`{name}` of {entry['core']} is in PR `{first}` and PR `{pr['key']}`")
                seen[entry["core"], name] = pr["key"]
    unassigned = []
    for relative in manifest["destinations"]:
        if core(relative).is_file():
            for name in definitions(ast.parse(core(relative).read_text())):
                test = "/tests/" in f"/{relative}"
                relevant = name.startswith("test_") if test else name not in manifest.get("not_carried", [])
                if relevant and (relative, name) not in seen:
                    unassigned.append(f"{relative}: {name}")
    return unassigned


def git(tree: Path, *args: str) -> str:
    """Run git in ``tree``; return its output."""
    return subprocess.run(["git", "-C", str(tree), *args], check=True, capture_output=True, text=True).stdout


def checkout(source: str, tree: Path) -> None:
    """Create ``tree`` as a new repository whose first commit holds Fabric's paths of ``GIT_DIR@REV``."""
    git_dir, _, rev = source.rpartition("@")
    tree.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "--git-dir", git_dir, "archive", rev, *FABRIC_PATHS], capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    git(tree, "init", "-q", "-b", "master")
    git(tree, "add", "-A")
    message = f"Lightning {rev} ({', '.join(FABRIC_PATHS)})"
    git(tree, "-c", "user.name=-", "-c", "user.email=-", "commit", "-q", "-m", message)


def main(argv: list[str] | None = None) -> int:
    """Write the series; print each PR's lines."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tree", type=Path, help="a Lightning source tree (git checkout or unpacked sdist)")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--series", metavar="BRANCH", help="create BRANCH at HEAD and commit one PR per commit")
    mode.add_argument("--apply", action="store_true", help="write the changes without committing")
    parser.add_argument("--only", type=int, default=0, help="stop after this PR (1-based)")
    parser.add_argument("--manifest", type=Path, default=MANIFEST)
    parser.add_argument("--config", type=Path, help="ruff configuration (default: the tree's pyproject.toml)")
    parser.add_argument("--ruff", default=str(Path(sys.executable).with_name("ruff")))
    parser.add_argument("--core", type=Path, action="append", help="read the core from this checkout (repeatable)")
    parser.add_argument("--from-git", metavar="GIT_DIR@REV", help="first create TREE from a repository's revision")
    args = parser.parse_args(argv)
    if args.from_git:
        checkout(args.from_git, args.tree)
    CORES[:] = [path.resolve() for path in args.core or [PROJECT]]
    tree = args.tree.resolve()
    manifest = tomllib.loads(args.manifest.read_text())
    config = (args.config or tree / "pyproject.toml").resolve()
    if "[tool.ruff" not in (config.read_text() if config.is_file() else ""):
        raise SeriesError(f"{config} has no ruff configuration: pass Lightning's pyproject.toml with --config")
    for line in check_assignment(manifest):
        print(f"warning: not in any PR: {line}")
    if args.series:
        if git(tree, "status", "--porcelain", "--untracked-files=no"):
            raise SeriesError(f"{tree} has uncommitted changes: the series starts from a clean checkout")
        git(tree, "checkout", "-q", "-b", args.series)
    prs = manifest["pr"][: args.only or None]
    if not (tree / "tests").is_dir():
        skipped = sum(1 for pr in prs for e in pr.get("edits", []) if e["file"].startswith("tests/"))
        carried = sum(len(e["names"]) for pr in prs for e in pr.get("tests", []))
        print(
            f"note: {tree} has no tests/ (an unpacked sdist?): {skipped} test edit(s) and {carried} carried test(s)"
            " of the series skipped; the source changes, the CHANGELOG and the docs are written where their files exist"
        )
    print(f"{'PR':<4}{'key':<8}{'src':>12}{'tests':>12}{'docs':>12}  title")
    for number, pr in enumerate(prs, 1):
        files = files_of(pr, manifest)
        before = {f: (tree / f).read_text() if (tree / f).exists() else "" for f in files}
        apply_pr(tree, pr, manifest, config, args.ruff)
        counts = numstat(before, tree)
        cells = "".join(f"{f'+{a}/-{r}':>12}" for a, r in counts.values())
        print(f"{number:<4}{pr['key']:<8}{cells}  {pr['title']}", flush=True)
        unfilled = PLACEHOLDER.findall(pr["description"])
        if unfilled:
            print(f"    {len(unfilled)} figure(s) to fill in the description: {', '.join(unfilled)}")
        if args.series:
            changed = [f for f in files if (tree / f).exists()]
            git(tree, "add", "--", *changed)
            message = f"{pr['title']}\n\n{textwrap.dedent(pr['description']).strip()}\n"
            identity = ["-c", "user.name=contributor", "-c", "user.email=contributor@users.noreply.github.com"]
            configured = subprocess.run(["git", "-C", str(tree), "config", "user.email"], capture_output=True).stdout
            subprocess.run(["git", "-C", str(tree), *([] if configured else identity), "commit", "-q", "-m", message],
                           check=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SeriesError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)
