"""The layer rules of ``cas`` as a checker over source trees: ranks, cycles, reach-through, size.

``check_tree(root)`` parses every module under ``root`` (a ``cas`` package directory) with ``ast``
and returns the violations, each naming the file, the line and the rule. ``tests/test_layers.py``
runs it on the real tree and on small planted trees. The ranks are the contract of the shared plan
(docs/design.md draws them):

- A module imports only from its own package or from packages of a lower rank (imports inside
  functions and under ``TYPE_CHECKING`` count: they are dependencies all the same). The flat root
  modules (``errors``, ``digest``, ``names``, ``units``) form one package, rank 0.
- No import cycle, neither between packages nor between modules.
- Only the store layers (``blobstore``, ``objects``, ``refs``, ``repo``; ``testing``) import
  ``cas.blobstore`` or use an attribute named ``blobs``; above ``repo`` no code uses the
  Repository's internals (``.objects``, ``.refs_store``, ``.io``, ``.leases``, ``.blobs``, and
  ``.stores``, ``.maintenance``, ``.chunk_cache``).
- No ``isinstance`` against a blobstore backend class outside ``blobstore``: backends describe
  themselves by capability properties.
- No module over ``MAX_LINES`` lines; at most ``MAX_FLAT`` modules flat in ``cas/``.
- torch is imported lazily (inside functions) and only by the modules that build tensors. A module
  that derives a class from a torch class needs torch when the class is defined, so it is the one
  place a module-level torch import is allowed: the base class decides, not a list of files.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT_PACKAGE = "cas"
FACE = "cas (public face)"
"""The pseudo-package of ``cas/__init__.py`` and ``cas/__main__.py``: they may import anything,
and nothing inside ``cas`` imports them."""
TESTING = "cas.testing"
RANKS: dict[str, int] = {
    ROOT_PACKAGE: 0,
    "cas.blobstore": 1,
    "cas.codecs": 1,
    "cas.formats": 1,
    "cas.model": 1,
    "cas.objects": 2,
    "cas.refs": 3,
    "cas.retention": 4,
    "cas.sync": 4,
    "cas.repo": 5,
    "cas.fs": 6,
    "cas.training": 6,
    "cas.ui": 7,
    "cas.cli": 8,
}
BLOB_HOLDERS = frozenset({"cas.blobstore", "cas.objects", "cas.refs", "cas.repo", TESTING})
"""Packages that may hold or call a BlobStore (import ``cas.blobstore``, use ``.blobs``)."""
REPO_RANK = RANKS["cas.repo"]
REPO_INTERNALS = frozenset(
    {"objects", "refs_store", "io", "leases", "blobs", "stores", "maintenance", "chunk_cache"}
)
"""Attributes of a Repository that code above ``cas.repo`` must not use."""
BACKEND_ABC = "BlobStore"
"""The abstract interface itself: ``isinstance(x, BlobStore)`` tells a store from a URL, not one
backend from another."""
TORCH_MODULES = (
    "cas.model.state",
    "cas.model.precision",
    "cas.formats",
    "cas.training",
    "cas.fs.torch_view",
)
"""Modules (or packages) that may import torch, inside functions."""
MAX_LINES = 600
MAX_FLAT = 8


@dataclass(frozen=True, order=True)
class Violation:
    """One broken rule: where, which rule, and what exactly."""

    path: str
    line: int
    rule: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: [{self.rule}] {self.message}"


@dataclass(frozen=True)
class Import:
    """One import edge from a module to a module of ``cas`` (or to torch)."""

    target: str
    line: int
    in_function: bool
    type_checking: bool


@dataclass
class Module:
    """A parsed module of the tree."""

    name: str
    path: Path
    rel: str
    tree: ast.Module
    lines: int
    imports: list[Import] = field(default_factory=list)

    @property
    def package(self) -> str:
        """The layer package this module belongs to."""
        if self.name in (ROOT_PACKAGE, f"{ROOT_PACKAGE}.__main__"):
            return FACE
        parts = self.name.split(".")
        is_init = self.path.name == "__init__.py"
        if len(parts) == 2 and not is_init:
            return ROOT_PACKAGE
        return ".".join(parts[:2])

    @property
    def is_package_init(self) -> bool:
        return self.path.name == "__init__.py"


_Make = Callable[[int, str, str], "Violation"]
"""The ``violation(line, rule, message)`` helper of ``_check_module``."""


def load_tree(root: Path) -> dict[str, Module]:
    """Every module under ``root`` (the ``cas`` directory), parsed, keyed by dotted name."""
    modules: dict[str, Module] = {}
    for path in sorted(root.rglob("*.py")):
        rel_parts = path.relative_to(root).with_suffix("").parts
        if rel_parts[-1] == "__init__":
            rel_parts = rel_parts[:-1]
        name = ".".join((ROOT_PACKAGE, *rel_parts))
        text = path.read_text()
        modules[name] = Module(
            name,
            path,
            str(Path(ROOT_PACKAGE) / path.relative_to(root)),
            ast.parse(text, filename=str(path)),
            len(text.splitlines()),
        )
    for module in modules.values():
        module.imports = list(_imports(module, modules))
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _walk(
    node: ast.AST, in_function: bool = False, type_checking: bool = False
) -> Iterator[tuple[ast.AST, bool, bool]]:
    """Every node with whether it sits inside a function and inside ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(node):
        yield child, in_function, type_checking
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.body:
                yield stmt, in_function, True
                yield from _walk(stmt, in_function, True)
            for stmt in child.orelse:
                yield stmt, in_function, type_checking
                yield from _walk(stmt, in_function, type_checking)
            continue
        nested = in_function or isinstance(
            child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
        )
        yield from _walk(child, nested, type_checking)


def _resolve(name: str, modules: dict[str, Module]) -> str:
    """The longest prefix of a dotted name that is a module of the tree."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return name


def _imports(module: Module, modules: dict[str, Module]) -> Iterator[Import]:
    for node, in_function, type_checking in _walk(module.tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = module.name.split(".")
                if not module.is_package_init:
                    anchor = anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                targets.append(submodule if submodule in modules else base)
        for target in targets:
            top = target.split(".")[0]
            if top == ROOT_PACKAGE:
                resolved = _resolve(target, modules)
            elif top == "torch":
                resolved = "torch"
            else:
                continue
            yield Import(resolved, node.lineno, in_function, type_checking)


def _package_of(name: str, modules: dict[str, Module]) -> str:
    if name in modules:
        return modules[name].package
    parts = name.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else FACE


def check_tree(root: Path) -> list[Violation]:
    """Every violation of the layer rules in the tree under ``root``, sorted by file and line."""
    modules = load_tree(root)
    found: list[Violation] = []
    flat = sorted(p.name for p in root.glob("*.py"))
    if len(flat) > MAX_FLAT:
        found.append(
            Violation(
                f"{ROOT_PACKAGE}/",
                0,
                "flat-modules",
                f"{len(flat)} modules flat in cas/ (at most {MAX_FLAT}): {', '.join(flat)}",
            )
        )
    for module in modules.values():
        found.extend(_check_module(module, modules))
    found.extend(_check_cycles(modules))
    return sorted(set(found))


def _check_module(module: Module, modules: dict[str, Module]) -> Iterator[Violation]:
    def violation(line: int, rule: str, message: str) -> Violation:
        return Violation(module.rel, line, rule, message)

    package = module.package
    if module.lines > MAX_LINES:
        yield violation(module.lines, "module-size", f"{module.lines} lines (at most {MAX_LINES})")
    if package not in RANKS and package not in (FACE, TESTING):
        yield violation(1, "unknown-package", f"{package} is not in the layer table")
    yield from _check_imports(module, modules, violation)
    yield from _check_attributes(module, violation)


def _check_imports(
    module: Module, modules: dict[str, Module], violation: _Make
) -> Iterator[Violation]:
    package = module.package
    rank = RANKS.get(package)
    torch_bases = _torch_base_classes(module)
    for edge in module.imports:
        if edge.target == "torch":
            yield from _check_torch(module, edge, torch_bases, violation)
            continue
        target_package = _package_of(edge.target, modules)
        if target_package == package or package in (FACE, TESTING):
            continue
        if target_package == FACE:
            yield violation(edge.line, "imports-face", f"imports the public face {edge.target!r}")
            continue
        if target_package == TESTING:
            yield violation(edge.line, "imports-testing", f"imports {edge.target} (test support)")
            continue
        if target_package == "cas.blobstore" and package not in BLOB_HOLDERS:
            yield violation(
                edge.line,
                "blobstore-import",
                f"imports {edge.target}: only {', '.join(sorted(BLOB_HOLDERS))} hold a BlobStore",
            )
            continue
        target_rank = RANKS.get(target_package)
        if rank is None or target_rank is None:
            continue  # reported as unknown-package
        if target_rank >= rank:
            yield violation(
                edge.line,
                "upward-import",
                f"{package} (rank {rank}) imports {edge.target} from {target_package} "
                f"(rank {target_rank}): imports must point to a lower rank",
            )


def _torch_base_classes(module: Module) -> bool:
    """Whether a class of the module derives from a name imported from torch."""
    torch_names: set[str] = set()
    for node, _, _ in _walk(module.tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            torch_names.update(alias.asname or alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            torch_names.update(
                (alias.asname or alias.name).split(".")[0]
                for alias in node.names
                if alias.name.split(".")[0] == "torch"
            )
    for node in module.tree.body:
        if isinstance(node, ast.ClassDef):
            for base in node.bases:
                root = base
                while isinstance(root, ast.Attribute):
                    root = root.value
                if isinstance(root, ast.Name) and root.id in torch_names:
                    return True
    return False


def _check_torch(
    module: Module, edge: Import, torch_bases: bool, violation: _Make
) -> Iterator[Violation]:
    if edge.type_checking:
        return  # annotations only: nothing is imported at run time
    allowed = any(module.name == m or module.name.startswith(m + ".") for m in TORCH_MODULES)
    if not allowed:
        yield violation(
            edge.line,
            "torch-import",
            f"imports torch; only {', '.join(TORCH_MODULES)} build tensors",
        )
    elif not edge.in_function and not torch_bases:
        yield violation(
            edge.line,
            "torch-at-module-level",
            "imports torch when the module is imported; import it inside the function that "
            "needs it (import cas and the CLI start without torch)",
        )


def _check_attributes(module: Module, violation: _Make) -> Iterator[Violation]:
    package = module.package
    above_repo = RANKS.get(package, -1) > REPO_RANK
    for node, _, _ in _walk(module.tree):
        if isinstance(node, ast.Attribute):
            if node.attr == "blobs" and package not in BLOB_HOLDERS:
                yield violation(
                    node.lineno,
                    "blobs-reach-through",
                    f"uses .blobs outside {', '.join(sorted(BLOB_HOLDERS))}",
                )
            elif above_repo and node.attr in REPO_INTERNALS:
                yield violation(
                    node.lineno,
                    "repo-internals",
                    f"uses .{node.attr} above cas.repo; add a named Repository operation",
                )
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "isinstance"
            and len(node.args) == 2
            and package != "cas.blobstore"
        ):
            for name in _class_names(node.args[1]):
                if name != BACKEND_ABC and (
                    name.endswith("BlobStore") or name in _blobstore_names(module)
                ):
                    yield violation(
                        node.lineno,
                        "backend-isinstance",
                        f"isinstance against the backend class {name}; ask a capability",
                    )


def _class_names(node: ast.expr) -> Iterator[str]:
    if isinstance(node, ast.Tuple):
        for element in node.elts:
            yield from _class_names(element)
    elif isinstance(node, ast.Name):
        yield node.id
    elif isinstance(node, ast.Attribute):
        yield node.attr


def _blobstore_names(module: Module) -> set[str]:
    """Names the module imported from ``cas.blobstore``."""
    names: set[str] = set()
    for node, _, _ in _walk(module.tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("cas.blobstore"):
            names.update(alias.asname or alias.name for alias in node.names)
    return names


def _check_cycles(modules: dict[str, Module]) -> Iterator[Violation]:
    module_edges: dict[str, dict[str, tuple[Module, int]]] = defaultdict(dict)
    package_edges: dict[str, dict[str, tuple[Module, int]]] = defaultdict(dict)
    for module in modules.values():
        for edge in module.imports:
            if edge.target not in modules or edge.target == module.name:
                continue
            module_edges[module.name].setdefault(edge.target, (module, edge.line))
            target_package = modules[edge.target].package
            if target_package != module.package:
                package_edges[module.package].setdefault(target_package, (module, edge.line))
    for kind, edges in (("module", module_edges), ("package", package_edges)):
        for cycle, component in _cycles(edges):
            where, line = edges[cycle[0]][cycle[1]]
            others = sorted(component - set(cycle))
            also = f" (also in the cycle: {', '.join(others)})" if others else ""
            yield Violation(
                where.rel,
                line,
                "import-cycle",
                f"{kind} import cycle: {' -> '.join([*cycle, cycle[0]])}{also}",
            )


def _cycles(
    edges: dict[str, dict[str, tuple[Module, int]]],
) -> Iterator[tuple[list[str], set[str]]]:
    """One cycle (as a node list) per strongly connected component of more than one node, and
    the component."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(node: str) -> None:
        # Tarjan's algorithm; the graphs are a few hundred nodes, recursion is fine.
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, {})):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component: set[str] = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(edges):
        if node not in index:
            visit(node)
    for component in components:
        start = min(component)
        yield _path_back(start, component, edges), component


def _path_back(
    start: str, component: set[str], edges: dict[str, dict[str, tuple[Module, int]]]
) -> list[str]:
    """A shortest cycle through ``start`` inside its component (breadth first)."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(edges.get(node, {})):
                if nxt not in component:
                    continue
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return list(reversed(path))
                if nxt not in previous:
                    previous[nxt] = node
                    following.append(nxt)
        frontier = following
    return [start]
