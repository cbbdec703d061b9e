"""Each thing has one owner: no class is defined by two modules (one kind of match, one
module), and no pass reads another module's module-level mutable state (what a pass needs
comes in through its context or the graph, so a compile cannot inherit what an earlier run
wrote there).

Read from the source with ``ast``; nothing is imported.
"""

from __future__ import annotations

import ast
from collections import defaultdict

from test_import_structure import package_modules

PASSES = "upipe_compile.passes"
MUTABLE_CALLS = {"dict", "list", "set", "defaultdict", "OrderedDict", "deque", "Counter", "WeakKeyDictionary",
                 "WeakValueDictionary", "WeakSet"}


def classes_by_name(modules: dict) -> dict[str, list[str]]:
    """Class name -> the modules defining it at their top level."""
    found = defaultdict(list)
    for module, path in modules.items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                found[node.name].append(module)
    return found


def _is_mutable_value(value: ast.expr) -> bool:
    if isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)):
        return True
    if isinstance(value, ast.Call):
        func = value.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        return name in MUTABLE_CALLS
    return False


def module_mutables(source: str) -> set[str]:
    """The module-level names that hold mutable state: a container bound at the top level, or a
    name a function rebinds through ``global``."""
    tree = ast.parse(source)
    names = set()
    for node in tree.body:
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        value = getattr(node, "value", None)
        if value is not None and _is_mutable_value(value):
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            names |= set(node.names)
    return names


def foreign_mutable_reads(source: str, module: str, modules: dict, mutables: dict[str, set[str]]) -> list[str]:
    """``line: module.name`` for each module-level mutable of another package module that
    ``source`` imports by name or reads as an attribute of that module."""
    package = module.rpartition(".")[0]
    aliases: dict[str, str] = {}  # local name -> the package module it is
    reads = []
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    top = alias.name.split(".")[0]  # ``import a.b`` binds ``a``; ``import a.b as c`` binds ``c``
                    aliases[alias.asname or top] = alias.name if alias.asname else top
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - (node.level - 1)] + ([node.module] if node.module else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                if submodule in modules:
                    aliases[alias.asname or alias.name] = submodule
                elif base in modules and base != module and alias.name in mutables.get(base, ()):
                    reads.append(f"{node.lineno}: {base}.{alias.name}")
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        chain, value = [node.attr], node.value  # ``pkg.mod.name`` -> ["pkg", "mod", "name"]
        while isinstance(value, ast.Attribute):
            chain.insert(0, value.attr)
            value = value.value
        if not isinstance(value, ast.Name) or value.id not in aliases:
            continue
        dotted = [aliases[value.id], *chain]
        owner = ".".join(dotted[:-1])
        if owner in modules and owner != module and dotted[-1] in mutables.get(owner, ()):
            reads.append(f"{node.lineno}: {owner}.{dotted[-1]}")
    return sorted(set(reads))


def test_no_class_is_defined_by_two_modules():
    """One owner per concept: a match kind (AttentionMatch, BlockMatch, MixerMatch, the refused
    op's), a refusal, a layout lives in one module; a second definition is a second concept
    under the first one's name."""
    twice = {name: owners for name, owners in classes_by_name(package_modules()).items() if len(owners) > 1}
    assert not twice, f"classes defined by more than one module: {twice}"


def test_each_match_kind_lives_in_one_pass_module():
    matches = {name: owners for name, owners in classes_by_name(package_modules()).items() if name.endswith("Match")}
    assert {"AttentionMatch", "BlockMatch", "MixerMatch"} <= set(matches)
    outside = {name: owners for name, owners in matches.items() if not owners[0].startswith(PASSES + ".")}
    assert not outside, f"match kinds outside {PASSES}: {outside}"


def test_no_pass_reads_another_modules_mutable_state():
    modules = package_modules()
    mutables = {module: module_mutables(path.read_text()) for module, path in modules.items()}
    found = {module: reads for module, path in modules.items() if module.startswith(PASSES + ".")
             for reads in [foreign_mutable_reads(path.read_text(), module, modules, mutables)] if reads}
    assert not found, ("passes read module-level mutable state of other modules (pass it in through the "
                       f"pass context or the graph instead): {found}")


def test_the_detectors_see_what_they_must():
    """Both checks fail on the shapes they forbid (synthetic sources)."""
    owner = """
import weakref
_TABLE: dict = {}
_SEEN = weakref.WeakKeyDictionary()
LIMIT = 4
_last = None
def remember(x):
    global _last
    _last = x
"""
    assert module_mutables(owner) == {"_TABLE", "_SEEN", "_last"}
    modules = dict.fromkeys([f"{PASSES}.reader", "upipe_compile.owner"])
    mutables = {"upipe_compile.owner": module_mutables(owner)}
    reader = """
from upipe_compile.owner import _TABLE, LIMIT
from upipe_compile import owner
import upipe_compile.owner as own
import upipe_compile.owner
def f():
    return owner._SEEN, own._last, owner.LIMIT, upipe_compile.owner._TABLE
"""
    modules = dict.fromkeys([f"{PASSES}.reader", "upipe_compile.owner", "upipe_compile"])
    assert foreign_mutable_reads(reader, f"{PASSES}.reader", modules, mutables) == [
        "2: upipe_compile.owner._TABLE", "7: upipe_compile.owner._SEEN", "7: upipe_compile.owner._TABLE",
        "7: upipe_compile.owner._last"]

