"""Attention that upipe does not rewrite, found so that the backend can refuse it.

Under context parallelism each rank holds only its shard of the sequence, so attention that
is not rewritten into UPipe attends over the local shard alone: a silent wrong answer.
:func:`find_unsupported_attention` finds the two spellings that would otherwise slip through,
in the root graph and every nested body (activation checkpointing, ...):

- ``flex_attention``: the ``torch.ops.higher_order.flex_attention`` node that
  ``torch.nn.attention.flex_attention`` (transformers' ``"flex_attention"``) puts in the graph.
- hand-written attention: a softmax over the product of two activations whose result is an
  operand of a product with a third activation (transformers' ``"eager"``, GPT-2's
  ``baddbmm``, GPT-OSS's sink column, Gemma 2's soft-capping)::

      scores = q @ k.transpose(-2, -1) * scale     # matmul / bmm / baddbmm / einsum / @
      scores = tanh(scores / cap) * cap + mask     # elementwise, casts, cat, slices (<= 12 nodes)
      probs = softmax(scores.float(), -1).to(dt)   # F.softmax, torch.softmax, Tensor.softmax, aten
      out = dropout(probs[..., :-1]) @ v           # casts, dropout, slices (<= 12 nodes)

  matches the softmax node (``scores`` and ``out`` are the two products). What tells it
  from a mixture-of-experts router (``softmax(x @ W.T)`` or ``softmax(linear(x, W))``) or a
  loss (``softmax(h @ W_vocab)``, ``log_softmax``, ``cross_entropy``) is that both operands
  of the scores product are activations: neither is a parameter, a buffer, a constant or
  something computed from those alone (``W.T``, ``sinks.expand(...)``).

Nothing is rewritten: the backend raises :class:`~upipe_compile.errors.UnsupportedAttention`
with each match's source line and fix. One pass over each graph's nodes, plus walks of at
most 12 nodes around each softmax.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from upipe_compile.passes.context import RefusedOp
from upipe_compile.passes.graph_utils import (example, graph_modules, in_package, is_weight_placeholder, source_line,
                                              trace_modules)

FLEX_ATTENTION = "flex_attention"
HAND_WRITTEN = "hand-written attention"

TRANSFORMERS_FIX = "load the model with attn_implementation=upipe_compile.integrations.transformers.register()"
FLEX_FIX = ("use scaled_dot_product_attention (or register() for transformers models); "
            "FlexAttention is not supported under upipe")
TORCHTITAN_FLEX_FIX = ('build the model with attn_backend="varlen" (torchtitan 0.3: model_registry(flavor, '
                       'attn_backend="varlen"); upipe runs its varlen_attn over the documents of the whole row) '
                       'or "sdpa" where the model offers it, and for a whole 0.3 job use upipe\'s Trainer '
                       '(--module upipe_compile.integrations.torchtitan: torchtitan\'s own context parallelism '
                       'refuses varlen); FlexAttention is not supported under upipe')
HAND_WRITTEN_FIX = "call torch.nn.functional.scaled_dot_product_attention (upipe rewrites it)"
OWN_ATTENTION_FIX = ("this transformers model computes attention in its own layer code, not through transformers' "
                     "attention interface, so register() cannot reach it: upipe cannot run this model with context "
                     "parallelism (train it without backend='upipe', or pick a family that uses the interface: Llama, "
                     "Mistral, Qwen, Gemma, ...)")

WALK_LIMIT = 12
"""Nodes visited on each side of a softmax (back to the scores product, on to the output)."""

# Ops by name, the same for torch functions, Tensor methods, operator.* and aten/prims ops.
_SOFTMAX = frozenset({"softmax", "_softmax", "_safe_softmax"})
_PRODUCTS = frozenset({"matmul", "__matmul__", "bmm", "mm", "baddbmm", "einsum"})
_PASS_THROUGH = frozenset({
    # elementwise: scale, soft-cap, mask
    "mul", "mul_", "imul", "div", "div_", "truediv", "itruediv", "true_divide", "add", "add_", "iadd", "sub", "sub_",
    "isub", "neg", "tanh", "tanh_", "where", "masked_fill", "masked_fill_", "clamp", "clamp_", "clamp_min",
    "clamp_max", "nan_to_num",
    # casts and copies
    "to", "_to_copy", "type", "type_as", "float", "half", "bfloat16", "double", "convert_element_type", "contiguous",
    "clone", "alias",
    # views, slices, the sink column
    "view", "_unsafe_view", "reshape", "view_as", "reshape_as", "expand", "expand_as", "unsqueeze", "squeeze",
    "flatten", "unflatten", "getitem", "slice", "select", "narrow", "cat", "concat", "concatenate",
    # attention dropout
    "dropout", "dropout_", "native_dropout", "feature_dropout",
})
_OP_NAMESPACES = ("aten", "prims")


@dataclass
class UnsupportedMatch(RefusedOp):
    """One attention call upipe does not rewrite (it would attend over the local shard only)."""

    graph_module: fx.GraphModule
    """The graph module that owns the node: the root, or a nested body (e.g. checkpointed)."""
    node: fx.Node
    """The flex_attention node, or the softmax of hand-written attention."""
    kind: str
    """``"flex_attention"`` or ``"hand-written attention"``."""
    source_line: str
    """``file:line in function: code`` of the call (the model's line, not torch's)."""
    fix: str
    scores: fx.Node | None = None
    """Hand-written attention: the product of two activations the softmax is over."""
    output: fx.Node | None = None
    """Hand-written attention: the product the softmax's result is an operand of."""

    @property
    def reason(self) -> str:
        """One line for the refusal: what the call is, why it cannot run, and the fix."""
        return (f"{self.kind} is not rewritten by upipe: it would attend over this rank's shard of the sequence "
                f"only; {self.fix}")


def find_unsupported_attention(gm: fx.GraphModule) -> list[UnsupportedMatch]:
    """Every flex_attention and hand-written attention in ``gm`` and its nested graph modules,
    in graph order (the root first)."""
    static: set[fx.Node] = set()  # nodes computed from no activation, over all modules
    callers: dict[int, list[tuple]] = {}  # id(body) -> the operands of each higher-order op calling it
    matches: list[UnsupportedMatch] = []
    for module in graph_modules(gm):  # named_modules is pre-order: a body comes after its caller
        candidates = _scan(module, static, callers)
        matches += filter(None, (_match(module, node, static) for node in candidates))
    return matches


# --- what is an activation ---------------------------------------------------------------
def _scan(gm: fx.GraphModule, static: set[fx.Node], callers: dict[int, list[tuple]]) -> list[fx.Node]:
    """The one pass over ``gm``'s nodes: add to ``static`` those that depend on no activation
    (parameters, buffers, attributes, constants, and what is computed from these alone),
    record the operands of the higher-order ops that call nested bodies, and return the
    flex_attention and softmax nodes."""
    candidates = []
    placeholders = len(gm.graph.find_nodes(op="placeholder"))
    calls = callers.get(id(gm), [])
    position = -1
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            position += 1
            if calls and all(len(args) == placeholders for args in calls):
                # a nested body: its inputs are the calling higher-order op's operands
                if all(not isinstance(args[position], fx.Node) or args[position] in static for args in calls):
                    static.add(node)
            elif is_weight_placeholder(node) or not isinstance(example(node), torch.Tensor):
                static.add(node)
        elif node.op == "get_attr":
            static.add(node)
        elif node.op in ("call_function", "call_method", "call_module"):
            if all(x in static for x in node.all_input_nodes):
                static.add(node)
            _record_bodies(gm, node, callers)
            if node.target is torch.ops.higher_order.flex_attention or _op_name(node) in _SOFTMAX:
                candidates.append(node)
    return candidates


def _record_bodies(gm: fx.GraphModule, node: fx.Node, callers: dict[int, list[tuple]]) -> None:
    """A higher-order op ``hop(body, *operands)``: remember the operands for ``body``'s placeholders."""
    for i, arg in enumerate(node.args):
        if isinstance(arg, fx.Node) and arg.op == "get_attr":
            body = _attribute(gm, arg.target)
            if isinstance(body, fx.GraphModule):
                # invoke_subgraph(body, "identifier", *operands): the name is no operand
                callers.setdefault(id(body), []).append(tuple(a for a in node.args[i + 1:] if not isinstance(a, str)))


def _attribute(gm: fx.GraphModule, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part, None)
    return value


# --- matching ----------------------------------------------------------------------------
def _op_name(node: fx.Node) -> str:
    if node.op == "call_method":
        return node.target
    if node.op != "call_function":
        return ""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        target = target.overloadpacket
    if isinstance(target, torch._ops.OpOverloadPacket):
        namespace, _, name = target._qualified_op_name.partition("::")
        return name if namespace in _OP_NAMESPACES else ""  # never upipe's own ops
    return getattr(target, "__name__", "")


def _product_operands(node: fx.Node) -> list[Any]:
    """The two multiplied tensors of a product node (empty if ``node`` is none)."""
    name = _op_name(node)
    if name not in _PRODUCTS:
        return []
    args = node.args
    if name == "baddbmm":
        return [args[1] if len(args) > 1 else node.kwargs.get("batch1"),
                args[2] if len(args) > 2 else node.kwargs.get("batch2")]
    if name == "einsum":
        operands = args[1:]
        if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
            operands = operands[0]
        return list(operands)
    return list(args[:2])


def _is_activation(arg: Any, static: set[fx.Node]) -> bool:
    return isinstance(arg, fx.Node) and arg not in static


def _product_of_activations(node: fx.Node, static: set[fx.Node]) -> bool:
    operands = _product_operands(node)
    return len(operands) >= 2 and sum(_is_activation(x, static) for x in operands) >= 2


def _match(gm: fx.GraphModule, node: fx.Node, static: set[fx.Node]) -> UnsupportedMatch | None:
    if node.target is torch.ops.higher_order.flex_attention:
        return UnsupportedMatch(gm, node, FLEX_ATTENTION, source_line(node), flex_fix(node))
    scores = _scores_product(node, static)
    output = _output_product(node, static) if scores is not None else None
    if output is None:
        return None
    line = source_line(node)
    return UnsupportedMatch(gm, node, HAND_WRITTEN, line, hand_written_fix(node, line), scores=scores, output=output)


def _scores_product(softmax: fx.Node, static: set[fx.Node]) -> fx.Node | None:
    """The product of two activations the softmax's input is computed from through
    elementwise ops, casts, views, slices and concatenation, or None."""
    start = softmax.args[0] if softmax.args else softmax.kwargs.get("input")
    if not _is_activation(start, static):
        return None
    queue, seen = deque([start]), {start}
    while queue and len(seen) <= WALK_LIMIT:
        node = queue.popleft()
        if _product_operands(node):
            if _product_of_activations(node, static):
                return node
            continue  # a product with a weight (router, logits): not attention scores
        if _op_name(node) not in _PASS_THROUGH:
            continue
        for x in node.all_input_nodes:
            if x not in static and x not in seen:
                seen.add(x)
                queue.append(x)
    return None


def _output_product(softmax: fx.Node, static: set[fx.Node]) -> fx.Node | None:
    """The product that multiplies the softmax's result (through casts, dropout, slices)
    with another activation, or None."""
    queue, seen = deque([softmax]), {softmax}
    while queue and len(seen) <= WALK_LIMIT:
        node = queue.popleft()
        for user in node.users:
            if user in seen:
                continue
            seen.add(user)
            operands = _product_operands(user)
            if operands:
                if node in operands and any(_is_activation(x, static) for x in operands if x is not node):
                    return user
            elif _op_name(user) in _PASS_THROUGH:
                queue.append(user)
    return None


# --- the fix, by where the call comes from ----------------------------------------------------
def _called_from(node: fx.Node, package: str) -> bool:
    """Whether a frame of the node's stack trace is code of ``package``, by the module each frame
    is (:func:`~upipe_compile.passes.graph_utils.module_of`), the same in a checkout and in
    site-packages: a folder of that name elsewhere (upipe's own ``integrations/torchtitan/``)
    is not the package."""
    return any(in_package(module, package) for module in trace_modules(node))


def flex_fix(node: fx.Node) -> str:
    """A flex_attention call's fix: transformers' (register()), torchtitan's (its varlen or sdpa
    backend), or plain SDPA."""
    if _called_from(node, "transformers"):
        return TRANSFORMERS_FIX
    return TORCHTITAN_FLEX_FIX if _called_from(node, "torchtitan") else FLEX_FIX


def hand_written_fix(node: fx.Node, line: str) -> str:
    """Hand-written attention's fix: in a transformers model, its "eager" attention function
    (register() replaces it) or the layer's own code (nothing can); else SDPA."""
    if not _called_from(node, "transformers"):
        return HAND_WRITTEN_FIX
    return TRANSFORMERS_FIX if " in eager_attention_forward" in line else OWN_ATTENTION_FIX
