"""FX helpers every pass shares: the graph modules nested in a graph, rewriting node by node,
a node's example value and static shape, the user's source line of a node, and whether a graph
input is a weight."""

from __future__ import annotations

import operator
import os
import re
import sys
from typing import Any, Callable, Iterator, Optional

import torch
import torch.fx as fx

from upipe_compile.errors import display_path, import_path


def graph_modules(gm: fx.GraphModule) -> Iterator[fx.GraphModule]:
    for _, module in gm.named_modules():
        if isinstance(module, fx.GraphModule):
            yield module


def rewrite_nodes(gm: fx.GraphModule, rewrite: Callable[[fx.GraphModule, fx.Node], bool]) -> int:
    """``rewrite(module, node)`` for every node of ``gm`` and of the graph modules nested in it
    (each module's nodes as they were before any rewrite); a module it changed is linted and
    recompiled. Returns how many calls changed a graph."""
    count = 0
    for module in graph_modules(gm):
        done = sum(bool(rewrite(module, node)) for node in list(module.graph.nodes))
        if done:
            module.graph.lint()
            module.recompile()
        count += done
    return count


def example(node) -> Any:
    """The fake value Dynamo (or a pass) recorded for ``node``; None for a constant."""
    if not isinstance(node, fx.Node):
        return None
    return node.meta.get("example_value", node.meta.get("val"))


def shape_of(node) -> Optional[tuple]:
    value = example(node)
    if isinstance(value, torch.Tensor) and all(type(d) is int for d in value.shape):
        return tuple(value.shape)
    return None  # unknown, or symbolic (dynamic shapes): not proven, the block is not fused


def is_weight_placeholder(node: fx.Node) -> bool:
    """A Dynamo graph input that is a parameter or a buffer (not mutated in the graph). Dynamo
    passes both as placeholders; a parameter's is typed ``nn.Parameter`` and its fake value
    has ``_is_param``; a buffer is known by its source, ``L['self']..._buffers['name']``."""
    if isinstance(node.type, type) and issubclass(node.type, torch.nn.Parameter):
        return True
    value = example(node)
    if isinstance(value, torch.nn.Parameter) or getattr(value, "_is_param", False):
        return True
    source = getattr(node.meta.get("grapharg"), "source", None)
    name = getattr(source, "name", "")
    name = name() if callable(name) else str(name)
    if "._parameters[" in name:
        return True
    # A buffer written in the graph (a KV cache) holds activations.
    return "._buffers[" in name and not any(_writes(user, node) for user in node.users)


def _writes(user: fx.Node, node: fx.Node) -> bool:
    if user.op == "call_method" and user.target.endswith("_") and not user.target.startswith("__"):
        return bool(user.args) and user.args[0] is node
    if user.op == "call_function":
        if user.target is operator.setitem:
            return user.args[0] is node
        schema = getattr(user.target, "_schema", None)
        return bool(schema is not None and schema.is_mutable)
    return False


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>\S+)\n(?P<code>[^\n]*)')


_LIBRARIES = ("torch", "upipe_compile")
_library_files: tuple[int, frozenset] = (0, frozenset())


def library_files() -> frozenset:
    """The files of every loaded module of torch and upipe_compile, found by module name, not by
    folder: in a checkout the package maps ``upipe_compile.passes`` and
    ``upipe_compile.integrations.torchtitan`` in from folders beside ``upipe_compile/``.
    Made again only when modules were loaded since (a model has many attention nodes)."""
    global _library_files
    loaded = len(sys.modules)
    if _library_files[0] != loaded:
        files = set()
        for name, module in list(sys.modules.items()):
            path = getattr(module, "__file__", None) if name.split(".", 1)[0] in _LIBRARIES else None
            if path:
                files.add(os.path.realpath(path))
        _library_files = (loaded, frozenset(files))
    return _library_files[1]


def source_line(node: fx.Node) -> str:
    """``file:line in function: code`` of the user's call (the innermost frame outside torch
    and upipe_compile: flex_attention records its node inside torch, document_sdpa and the
    transformers attention function inside upipe), from the node's stack trace."""
    last = _source_frame(node)
    if last is None:
        return f"<graph node {node.name}, no source line recorded>"
    return f'{display_path(last["file"])}:{last["line"]} in {last["fn"]}: {last["code"].strip()}'


def _source_frame(node: fx.Node):
    """The frame :func:`source_line` names, or None where the node has no stack trace."""
    frames = list(_FRAME.finditer(node.meta.get("stack_trace") or ""))
    if not frames:
        return None
    library = library_files()
    outside = [frame for frame in frames if os.path.realpath(frame["file"]) not in library]
    return (outside or frames)[-1]


def source_module(node: fx.Node) -> str:
    """The module of the frame :func:`source_line` names (:func:`module_of`; "" where unknown)."""
    frame = _source_frame(node)
    return "" if frame is None else module_of(frame["file"])


def trace_modules(node: fx.Node) -> list[str]:
    """The module of every frame of the node's stack trace, outermost first (:func:`module_of`)."""
    return [module_of(frame["file"]) for frame in _FRAME.finditer(node.meta.get("stack_trace") or "")]


def in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


_module_files: tuple[int, dict] = (0, {})


def module_of(path: str) -> str:
    """The dotted name of the module a source file is, decided by module and never by the names
    of the folders above it: the loaded module whose ``__file__`` it is (a checkout's
    ``integrations/torchtitan/`` is ``upipe_compile.integrations.torchtitan``, not torchtitan),
    else its path from the ``sys.path`` entry holding it (``.../site-packages/transformers/models/
    llama/modeling_llama.py`` and a checkout's ``.../src/transformers/cache_utils.py`` alike); ""
    for neither (``<eval_with_key>.3``, a file outside every import root)."""
    global _module_files
    loaded = len(sys.modules)
    if _module_files[0] != loaded:
        files = {}
        for name, module in list(sys.modules.items()):
            try:
                file = getattr(module, "__file__", None)
            except Exception:  # a lazy module may fail on any attribute; it names no frame's file
                continue
            if isinstance(file, str) and not name.startswith("__"):  # __main__, __mp_main__: a script
                files.setdefault(os.path.realpath(file), name)
        _module_files = (loaded, files)
    if not os.path.isabs(path):
        return ""
    name = _module_files[1].get(os.path.realpath(path))
    if name is not None:
        return name
    imported = import_path(path)
    if imported is None or not imported.endswith(".py"):
        return ""
    parts = imported[:-len(".py")].split(os.sep)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def function_of(source_line: str) -> str:
    """``file in function`` of a ``file:line in function: code`` source line."""
    where, _, _ = source_line.partition(": ")
    file, _, rest = where.partition(":")
    return f"{file} {rest.partition(' in ')[2]}"
