"""Locate every scaled_dot_product_attention call in an FX graph, nested bodies included,
and every ``upipe::document_sdpa`` (SDPA within packed documents, see
:mod:`upipe_compile.packed.document_sdpa`), which carries its boundaries as ``cu_seqlens``."""

from __future__ import annotations

import inspect
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx
import torch.nn.functional as F

import upipe_compile.packed.document_sdpa  # noqa: F401  (registers upipe::document_sdpa)

# Dynamo records F.scaled_dot_product_attention (the same object as
# torch._C._nn.scaled_dot_product_attention); graphs traced below Dynamo carry the aten op.
SDPA_TARGETS = (
    F.scaled_dot_product_attention,
    torch.ops.aten.scaled_dot_product_attention,
    torch.ops.aten.scaled_dot_product_attention.default,
)

# SDPA's Python signature, so positional and keyword spellings normalise alike.
def _sdpa_signature(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    pass


SDPA_SIGNATURE = inspect.signature(_sdpa_signature)

DOCUMENT_SDPA = torch.ops.upipe.document_sdpa.default


def _document_sdpa_signature(q, k, v, cu_seqlens, is_causal, scale, window_left=-1, window_right=-1, softcap=0.0,
                             sinks=None, alibi_slopes=None):
    pass


_DOCUMENT_SIGNATURE = inspect.signature(_document_sdpa_signature)


@dataclass
class AttentionMatch:
    """One SDPA call and the arguments it was given (FX nodes or Python constants)."""

    graph_module: fx.GraphModule
    """The graph module that owns the node: the root, or a nested body (e.g. checkpointed)."""
    node: fx.Node
    query: fx.Node
    key: fx.Node
    value: fx.Node
    attn_mask: Any
    dropout_p: Any
    is_causal: Any
    scale: Any
    enable_gqa: Any
    cu_seqlens: Any = None
    """Document boundaries over the full sequence (``upipe::document_sdpa``); None for SDPA."""
    window_left: Any = -1
    """Sliding window (``upipe::document_sdpa`` only; flash-attn's counting, -1 = unbounded)."""
    window_right: Any = -1
    softcap: Any = 0.0
    sinks: Any = None
    """Per-query-head sink logits ``[Hq]`` (an FX node), or None."""
    alibi_slopes: Any = None
    """Per-query-head ALiBi slopes ``[Hq]`` (an FX node), or None."""

    @property
    def source_line(self) -> str:
        return source_line(self.node)

    @property
    def returns_lse(self) -> bool:
        """``upipe::document_sdpa`` returns ``(out, lse)``; SDPA the output alone."""
        return self.node.target is DOCUMENT_SDPA

    @property
    def has_variant(self) -> bool:
        """A window, softcap, sinks or ALiBi: attention SDPA itself cannot express."""
        return ((self.window_left, self.window_right, self.softcap) != (-1, -1, 0.0) or self.sinks is not None
                or self.alibi_slopes is not None)


def find_attention(gm: fx.GraphModule) -> list[AttentionMatch]:
    """Every SDPA call in ``gm`` and in the graph modules nested in it, in graph order."""
    return [match for module in _graph_modules(gm) for match in _matches_in(module)]


def _graph_modules(gm: fx.GraphModule) -> Iterator[fx.GraphModule]:
    for _, module in gm.named_modules():
        if isinstance(module, fx.GraphModule):
            yield module


def rewrite_nodes(gm: fx.GraphModule, rewrite: Callable[[fx.GraphModule, fx.Node], bool]) -> int:
    """``rewrite(module, node)`` for every node of ``gm`` and of the graph modules nested in it
    (each module's nodes as they were before any rewrite); a module it changed is linted and
    recompiled. Returns how many calls changed a graph."""
    count = 0
    for module in _graph_modules(gm):
        done = sum(bool(rewrite(module, node)) for node in list(module.graph.nodes))
        if done:
            module.graph.lint()
            module.recompile()
        count += done
    return count


def _matches_in(gm: fx.GraphModule) -> Iterator[AttentionMatch]:
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in SDPA_TARGETS:
            bound = SDPA_SIGNATURE.bind(*node.args, **node.kwargs)
            bound.apply_defaults()
            yield AttentionMatch(graph_module=gm, node=node, **bound.arguments)
        elif node.op == "call_function" and node.target is DOCUMENT_SDPA:
            bound = _DOCUMENT_SIGNATURE.bind(*node.args, **node.kwargs)
            bound.apply_defaults()
            args = bound.arguments
            yield AttentionMatch(
                graph_module=gm, node=node, query=args["q"], key=args["k"], value=args["v"], attn_mask=None,
                dropout_p=0.0, is_causal=args["is_causal"], scale=args["scale"], enable_gqa=True,
                cu_seqlens=args["cu_seqlens"], window_left=args["window_left"], window_right=args["window_right"],
                softcap=args["softcap"], sinks=args["sinks"], alibi_slopes=args["alibi_slopes"],
            )


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
    frames = list(_FRAME.finditer(node.meta.get("stack_trace") or ""))
    if not frames:
        return f"<graph node {node.name}, no source line recorded>"
    library = library_files()
    outside = [frame for frame in frames if os.path.realpath(frame["file"]) not in library]
    last = (outside or frames)[-1]
    return f'{last["file"]}:{last["line"]} in {last["fn"]}: {last["code"].strip()}'
