"""The package's imports run one way: no circle between modules, and no module imports a
layer above its own.

The import graph is read from the source with ``ast`` (nothing is imported): every
``import`` and ``from ... import`` of a package module is an arrow, at module level or inside
a function (a function-level import only hides a circle until that function runs). Imports
under ``if TYPE_CHECKING:`` are skipped: they never run.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# package name -> its folder (pyproject's package-dir maps passes/ and integrations/torchtitan/ in)
PACKAGE_DIRS = {
    "upipe_compile": ROOT / "upipe_compile",
    "upipe_compile.passes": ROOT / "passes",
    "upipe_compile.integrations.torchtitan": ROOT / "integrations" / "torchtitan",
}

# The layers, lowest first: a module may import modules of its own layer or of a lower one.
# A module belongs to the longest prefix naming it (itself or a package above it).
LAYERS = [
    "upipe_compile.errors",
    "upipe_compile.launch",
    "upipe_compile.sequence_marks",  # marks on sharded tensors: sharding sets them, the passes read them
    "upipe_compile.attention",       # the plain op: schedule, kernels, collectives (no FX)
    "upipe_compile.options",         # the options name attention's kernels and prefetch modes
    "upipe_compile.sharding",        # sequence shards over the attention's groups
    "upipe_compile.block",           # the fused attention block
    "upipe_compile.mixers",          # hybrid mixers as stage loops
    "upipe_compile.packed",          # document_sdpa, the user's packed-sequence helper
    "upipe_compile.stack",           # offload, tiled MLP, chunked loss around the blocks
    "upipe_compile.passes",          # FX graph passes
    "upipe_compile.backend",
    "upipe_compile.api",
    "upipe_compile.measure",         # measuring code (the backend's eager twins)
    "upipe_compile.estimate",        # the whole-step estimate: measures and reports jobs the integrations build
    "upipe_compile.integrations",    # transformers, the hf_* trainers, torchtitan; their estimate jobs
    "upipe_compile",                 # the package's __init__: re-exports the public API
]

# Arrows that still run upward, in code whose owners are moving them: (importer, imported).
# Remove an entry once its arrow is gone; never add one to make a new arrow pass.
KNOWN_UPWARD: set[tuple[str, str]] = set()

# Circles that still stand, in code whose owners are untangling them (each: its modules).
KNOWN_CIRCLES: set[frozenset[str]] = set()


def package_modules() -> dict[str, Path]:
    """Every module's dotted name -> its file."""
    modules = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class _ImportCollector(ast.NodeVisitor):
    """The package modules a module imports, each with the first line importing it;
    TYPE_CHECKING blocks skipped."""

    def __init__(self, module: str, is_package: bool, modules: dict[str, Path]):
        self.module, self.modules = module, modules
        self.package = module if is_package else module.rpartition(".")[0]
        self.arrows: dict[str, int] = {}

    def _add(self, name: str, line: int):
        target = _resolve(name, self.modules)
        if target is not None and target != self.module:
            self.arrows.setdefault(target, line)

    def visit_If(self, node: ast.If):
        if not _is_type_checking(node.test):
            self.visit(node.test)
            for child in node.body:
                self.visit(child)
        for child in node.orelse:
            self.visit(child)

    def visit_Import(self, node: ast.Import):
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom):
        base = node.module or ""
        if node.level:
            parts = self.package.split(".")
            base = ".".join(parts[:len(parts) - (node.level - 1)] + ([node.module] if node.module else []))
        for alias in node.names:
            # ``from pkg import name`` imports the module pkg.name when there is one, else a name of pkg
            submodule = f"{base}.{alias.name}"
            self._add(submodule if submodule in self.modules else base, node.lineno)


def _resolve(name: str, modules: dict[str, Path]):
    """The package module an imported name lands in (its longest module prefix), or None."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def imports_of(source: str, module: str, is_package: bool, modules: dict[str, Path]) -> dict[str, int]:
    """The package modules ``module``'s source imports -> the first line importing each."""
    collector = _ImportCollector(module, is_package, modules)
    collector.visit(ast.parse(source))
    return collector.arrows


@functools.cache
def import_graph() -> dict[str, dict[str, int]]:
    """importer -> {imported module: first line importing it}, package modules only."""
    modules = package_modules()
    return {module: imports_of(path.read_text(), module, path.name == "__init__.py", modules)
            for module, path in modules.items()}


def layer_of(module: str) -> int:
    """The index in LAYERS of the longest prefix naming ``module``."""
    matching = [i for i, prefix in enumerate(LAYERS) if module == prefix or module.startswith(prefix + ".")]
    return max(matching, key=lambda i: len(LAYERS[i]))


def import_circles(graph: dict[str, dict[str, int]]) -> list[set[str]]:
    """The modules that import each other round a circle, one set per tangle (the graph's
    strongly connected components of more than one module, by Tarjan's algorithm)."""
    index: dict[str, int] = {}
    lowest: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(module: str):
        index[module] = lowest[module] = len(index)
        stack.append(module)
        for target in graph.get(module, {}):
            if target not in index:
                visit(target)
                lowest[module] = min(lowest[module], lowest[target])
            elif target in stack:
                lowest[module] = min(lowest[module], index[target])
        if lowest[module] == index[module]:
            tangle = set()
            while True:  # the component's modules sit on the stack above ``module``
                member = stack.pop()
                tangle.add(member)
                if member == module:
                    break
            if len(tangle) > 1:
                circles.append(tangle)

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return circles


def one_circle(graph: dict[str, dict[str, int]], tangle: set[str]) -> list[str]:
    """The arrows of one circle through the tangle, for the message: "a -> b (line n)"."""
    start = min(tangle)
    came_from = {start: None}
    frontier = [start]
    while frontier:  # breadth first, inside the tangle, back to start
        next_frontier = []
        for module in frontier:
            for target in sorted(graph[module]):
                if target == start:
                    path = [module]
                    while came_from[path[-1]] is not None:
                        path.append(came_from[path[-1]])
                    path = path[::-1] + [start]
                    return [f"{a} -> {b} (line {graph[a][b]})" for a, b in zip(path, path[1:])]
                if target in tangle and target not in came_from:
                    came_from[target] = module
                    next_frontier.append(target)
        frontier = next_frontier
    raise AssertionError(f"no circle through {start}")


def test_the_graph_sees_the_mapped_packages():
    graph = import_graph()
    assert "upipe_compile.passes.find" in graph and "upipe_compile.integrations.torchtitan.config" in graph
    assert "upipe_compile.attention.checks" in graph["upipe_compile.api"]


def test_which_imports_are_arrows():
    modules = dict.fromkeys(["upipe_compile.a", "upipe_compile.a.low", "upipe_compile.a.other", "upipe_compile.b",
                             "upipe_compile.c", "upipe_compile.d", "upipe_compile.e"])
    source = """
from typing import TYPE_CHECKING
import torch
from upipe_compile.a import low          # a submodule: the arrow is to it, not to the package
from .other import thing                 # relative, from inside package a
import upipe_compile.b as b
if TYPE_CHECKING:
    from upipe_compile.c import Skipped  # never runs
else:
    from upipe_compile.e import Runs
def f():
    from upipe_compile.d import late     # runs when f does: an arrow too
"""
    arrows = imports_of(source, "upipe_compile.a.mod", False, modules)
    assert arrows == {"upipe_compile.a.low": 4, "upipe_compile.a.other": 5, "upipe_compile.b": 6,
                      "upipe_compile.e": 10, "upipe_compile.d": 12}


def test_every_module_has_its_own_layer():
    """A new top-level module must be placed in LAYERS, not fall into the package's own layer."""
    unplaced = [module for module in package_modules()
                if module != "upipe_compile" and LAYERS[layer_of(module)] == "upipe_compile"]
    assert not unplaced, f"add these to LAYERS: {unplaced}"


def test_no_import_circle():
    graph = import_graph()
    circles = [tangle for tangle in import_circles(graph) if frozenset(tangle) not in KNOWN_CIRCLES]
    messages = ["\n    ".join(one_circle(graph, tangle)) for tangle in circles]
    assert not circles, "import circles:\n    " + "\n  and\n    ".join(messages)
    gone = [sorted(known) for known in KNOWN_CIRCLES if set(known) not in import_circles(graph)]
    assert not gone, f"these KNOWN_CIRCLES are gone, remove them from the list: {gone}"


def test_no_floor_module_imports_an_integration():
    """Everything below the integrations (the estimate included) serves every integration alike:
    it runs, and installs, without transformers or torchtitan. An integration hands what it
    must in (the estimate's job sources: entry points, upipe_compile.estimate.job_sources)."""
    graph = import_graph()
    integrations = LAYERS.index("upipe_compile.integrations")
    found = sorted(f"{importer} -> {imported} (line {line})"
                   for importer, arrows in graph.items() if layer_of(importer) < integrations
                   for imported, line in arrows.items() if layer_of(imported) == integrations)
    assert not found, ("modules below upipe_compile.integrations import an integration (at module level or "
                       "inside a function); move the integration-specific code into the integration, or have "
                       "the integration hand it in:\n  " + "\n  ".join(found))


def test_imports_run_down_the_layers():
    graph = import_graph()
    upward = {(importer, imported): line for importer, arrows in graph.items() for imported, line in arrows.items()
              if layer_of(imported) > layer_of(importer)}
    new = sorted(f"{a} -> {b} (line {line}): layer {LAYERS[layer_of(a)]} imports {LAYERS[layer_of(b)]}"
                 for (a, b), line in upward.items() if (a, b) not in KNOWN_UPWARD)
    assert not new, "imports from a lower layer to a higher one:\n  " + "\n  ".join(new)
    gone = sorted(KNOWN_UPWARD - set(upward))
    assert not gone, f"these KNOWN_UPWARD arrows are gone, remove them from the list: {gone}"
