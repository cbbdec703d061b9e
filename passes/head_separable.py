"""Prove a q/k/v chain head-separable and extract it as a head fn for any head count n.

A chain is every node between one projection (``linear(x, W, b)``, or a row-slice of a
fused projection) and the SDPA input it feeds: the descendants of the projection that are
ancestors of the SDPA input. The proof tracks where the head axis is in each node:

    projected [B, s, H*D]        fused: heads outermost in the last dim
    view (B, s, H, D)            split: axis 2 (a view/reshape that splits H*D into H, ...)
    rms_norm(..., (D,), w)       keeps axis 2 (normalises dims after it only)
    transpose(1, 2)              moves it to axis 1
    * cos + rotate_half(.) * sin keeps it; cos/sin are 1 (or absent) at the head axis
    pad(..., (0, p))             keeps it (pads dims after it only: MLA's v to q/k's head dim)
    k_rot.expand(B, H, s, r)     a head-shared tensor (1 at the head axis) broadcast to the
                                 heads joins the chain there (MLA's rotary key part)
    SDPA input [B, H, s, D]      axis 1: proven

Before -> after (the chain of one role, e.g. HF Llama's q with rotate-half RoPE):

    linear = linear(x, Wq)                     head_fn(projected, n, cos, sin):
    view = linear.view((2, 16, -1, 8))   ->      view = projected.view((2, 16, -1, 8))
    q = view.transpose(1, 2)                     q = view.transpose(1, 2)
    ... q * cos3 + cat(-x2, x1) * sin3 ...       ... q * cos3 + cat(-x2, x1) * sin3 ...
    sdpa(q_embed, ...)                           return q_embed

where the head count at the head axis of every shape argument (``view(2, 16, 16, 8)``) is
replaced by the placeholder ``n`` (``-1`` is kept), and every tensor the chain reads from
outside (``cos3``, ``sin3``, norm weights) becomes an extra placeholder, the same list for
q, k and v. Anything the rules below do not know is refused with the node and its source line.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from upipe_compile.passes.graph_utils import example, shape_of, source_line


class NotSeparable(Exception):
    """Why a chain is not head-separable, naming the node and its source line."""

    def __init__(self, node: fx.Node, why: str):
        self.node = node
        super().__init__(f"node {node.name} ({_describe(node)}) at {source_line(node)}: {why}")


def _describe(node: fx.Node) -> str:
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    return f"{node.op} {target}"


LINEAR_TARGETS = (torch._C._nn.linear, F.linear, torch.ops.aten.linear.default)

# Ops that keep the head axis where it is (elementwise, broadcasting right-aligned).
_ELEMENTWISE_FUNCTIONS = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow, operator.iadd,
    operator.imul, torch.add, torch.sub, torch.mul, torch.div, torch.neg, torch.pow, torch.rsqrt, torch.sqrt,
    torch.exp, torch.tanh, torch.sigmoid, torch.sin, torch.cos, F.silu, F.gelu, torch.square, torch.abs,
    torch.clamp, torch.where,
}
_ELEMENTWISE_METHODS = {
    "add", "sub", "mul", "div", "neg", "pow", "rsqrt", "sqrt", "exp", "float", "double", "half", "bfloat16",
    "to", "type", "type_as", "contiguous", "clone", "abs", "square", "clamp", "sigmoid", "tanh", "sin", "cos",
}
_DTYPE_ONLY_SECOND = {"type_as"}  # the second operand gives only a dtype (no broadcasting)
_RMS_NORM = (torch.rms_norm, F.rms_norm)
_PAD = (F.pad, torch._C._nn.pad)
_VIEW_METHODS = {"view", "reshape"}


@dataclass
class Chain:
    """One role's proven chain."""

    projection: fx.Node
    """The node whose value is ``projected`` (the linear, or the fused linear's row-slice)."""
    output: fx.Node
    """The SDPA input ``[B, H, s, D]``."""
    nodes: list  # in graph order, projection excluded
    heads: int
    shape_args: dict  # node -> (arg path, axis) to replace by n
    externals: list  # tensor nodes read from outside the chain, in graph order


def chain_nodes(projection: fx.Node, output: fx.Node) -> list[fx.Node]:
    """Descendants of ``projection`` that are ancestors of ``output`` (inclusive), graph order."""
    ancestors, stack = set(), [output]
    while stack:
        node = stack.pop()
        if node in ancestors or node is projection:
            continue
        ancestors.add(node)
        stack.extend(node.all_input_nodes)
    descendants, stack = set(), [projection]
    while stack:
        node = stack.pop()
        for user in node.users:
            if user not in descendants and user in ancestors:
                descendants.add(user)
                stack.append(user)
    return [n for n in output.graph.nodes if n in descendants]


def _norm(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _arg(node: fx.Node, index: int, name: str, default=None):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _shape_arg_form(node: fx.Node, start: int):
    """Where a view/reshape/expand's shape lives: ('varargs', start) or ('tuple', index)."""
    rest = node.args[start:]
    if len(rest) == 1 and isinstance(rest[0], (tuple, list)):
        return "tuple", start
    if not rest and "size" in node.kwargs:
        return "kw", "size"
    if not rest and "shape" in node.kwargs:
        return "kw", "shape"
    return "varargs", start


def head_broadcast_axis(node, heads: int) -> Optional[int]:
    """The axis a node broadcasts a head-shared tensor to ``heads`` along (an ``expand``
    whose only change is 1 -> heads at one axis), or None."""
    if not (isinstance(node, fx.Node) and node.op == "call_method" and node.target == "expand"):
        return None
    in_shape, out_shape = shape_of(node.args[0]), shape_of(node)
    if in_shape is None or out_shape is None or len(in_shape) != len(out_shape):
        return None
    changed = [a for a, (i, o) in enumerate(zip(in_shape, out_shape)) if i != o]
    if len(changed) == 1 and in_shape[changed[0]] == 1 and out_shape[changed[0]] == heads:
        return changed[0]
    return None


def prove_chain(projection: fx.Node, output: fx.Node, heads: int, head_dim: int) -> Chain:
    """Track the head axis from ``projection`` to ``output``; raise NotSeparable on any node
    the rules do not cover. ``projection``'s last dim holds ``heads`` equal blocks of rows
    (``head_dim`` each, or more where the chain splits a head's rows later: MLA's k and v)."""
    nodes = chain_nodes(projection, output)
    # head-shared tensors broadcast to the heads join the chain: each head count n gets n copies
    nodes += [a for n in nodes for a in n.all_input_nodes
              if a not in nodes and a is not projection and head_broadcast_axis(a, heads) is not None]
    nodes = [n for n in output.graph.nodes if n in set(nodes)]
    in_chain = set(nodes) | {projection}
    shape = shape_of(projection)
    if shape is None:
        raise NotSeparable(projection, "its shape is unknown (no example value)")
    if shape[-1] % heads or shape[-1] < heads * head_dim:
        raise NotSeparable(projection, f"its last dim {shape[-1]} is not {heads} heads of at least {head_dim}")
    # state: ("fused", axis) -- heads outermost in a dim of size H * (rest); ("split", axis)
    # -- the head axis itself; ("tuple", axis) -- a split/chunk result whose items are split.
    state: dict[fx.Node, tuple] = {projection: ("fused", len(shape) - 1)}
    shape_args: dict[fx.Node, tuple] = {}
    externals: list[fx.Node] = []

    def external(n):
        if n not in in_chain and n not in externals:
            if not isinstance(example(n), torch.Tensor):
                raise NotSeparable(n, "a chain reads a non-tensor value computed in the graph (symbolic size?)")
            externals.append(n)

    for node in nodes:
        inputs = [a for a in node.all_input_nodes if a in in_chain]
        for a in node.all_input_nodes:
            if a not in in_chain:
                external(a)
        ins = {a: state[a] for a in inputs}
        state[node] = _step(node, ins, heads, shape_args)
    kind, axis = state[output]
    out_shape = shape_of(output)
    if kind != "split" or axis != 1 or out_shape is None or out_shape[1] != heads or out_shape[-1] != head_dim:
        raise NotSeparable(output, f"the SDPA input does not have its heads at dim 1 (head axis: {kind} {axis})")
    externals.sort(key=_order(output.graph))
    return Chain(projection, output, nodes, heads, shape_args, externals)


def _order(graph: fx.Graph):
    index = {n: i for i, n in enumerate(graph.nodes)}
    return lambda n: index[n]


def _step(node: fx.Node, ins: dict, heads: int, shape_args: dict) -> tuple:
    out_shape = shape_of(node)
    if len(ins) == 0 and (axis := head_broadcast_axis(node, heads)) is not None:
        shape_args[node] = (_shape_arg_form(node, 1), axis)
        return ("split", axis)
    if len(ins) == 0:
        raise NotSeparable(node, "reads no chain value")
    target = node.target
    method = target if node.op == "call_method" else None
    first = node.args[0] if node.args else None

    # a split/chunk result's items
    if node.op == "call_function" and target is operator.getitem and first in ins and ins[first][0] == "tuple":
        return ("split", ins[first][1])
    kinds = {s[0] for s in ins.values()}
    if "tuple" in kinds:
        raise NotSeparable(node, "uses a split/chunk result other than by indexing it")

    if method in _VIEW_METHODS or (node.op == "call_function" and target is torch.reshape):
        return _view(node, ins, heads, shape_args, out_shape)
    if method in ("transpose", "swapaxes") or (node.op == "call_function" and target in (torch.transpose,)):
        kind, axis = ins[first]
        ndim = len(shape_of(first))
        a, b = _norm(node.args[1], ndim), _norm(node.args[2], ndim)
        if kind == "fused" and axis in (a, b):
            raise NotSeparable(node, "moves the fused heads x head_dim dim")
        return (kind, b if axis == a else a if axis == b else axis)
    if method == "permute" or (node.op == "call_function" and target is torch.permute):
        kind, axis = ins[first]
        dims = node.args[1:] if not (len(node.args) == 2 and isinstance(node.args[1], (tuple, list))) else node.args[1]
        ndim = len(shape_of(first))
        dims = [_norm(d, ndim) for d in dims]
        if kind == "fused":
            raise NotSeparable(node, "permutes before the heads are split out of the projection")
        return (kind, dims.index(axis))
    if method == "unsqueeze" or (node.op == "call_function" and target is torch.unsqueeze):
        kind, axis = ins[first]
        d = _norm(_arg(node, 1, "dim"), len(out_shape))
        return (kind, axis + 1 if d <= axis else axis)
    if method == "squeeze" or (node.op == "call_function" and target is torch.squeeze):
        kind, axis = ins[first]
        in_shape = shape_of(first)
        d = _arg(node, 1, "dim")
        dims = range(len(in_shape)) if d is None else [_norm(x, len(in_shape)) for x in (d if isinstance(d, (tuple, list)) else [d])]
        removed = [x for x in dims if in_shape[x] == 1]
        if axis in removed:
            raise NotSeparable(node, "squeezes the head axis")
        return (kind, axis - sum(1 for x in removed if x < axis))
    if method == "flatten" or (node.op == "call_function" and target is torch.flatten):
        kind, axis = ins[first]
        ndim = len(shape_of(first))
        start, end = _norm(_arg(node, 1, "start_dim", 0), ndim), _norm(_arg(node, 2, "end_dim", -1), ndim)
        if kind != "split" or start <= axis:
            raise NotSeparable(node, "flattens the head axis (only dims after it may be flattened)")
        return (kind, axis)
    if node.op == "call_function" and target is torch.view_as_complex:
        kind, axis = ins[first]
        if kind != "split" or axis >= len(shape_of(first)) - 1:
            raise NotSeparable(node, "view_as_complex over the head axis")
        return (kind, axis)
    if node.op == "call_function" and target is torch.view_as_real:
        kind, axis = ins[first]
        if kind != "split":
            raise NotSeparable(node, "view_as_real before the heads are split out")
        return (kind, axis)
    if node.op == "call_function" and target in _RMS_NORM:
        kind, axis = ins[first]
        normalized = _arg(node, 1, "normalized_shape")
        count = len(normalized) if isinstance(normalized, (tuple, list)) else 1
        if kind != "split" or axis >= len(out_shape) - count:
            raise NotSeparable(node, "normalises over the head axis (the whole projection, across heads)")
        _check_not_in_chain_except_first(node, ins)
        return (kind, axis)
    if method in ("mean", "sum", "amax", "amin") or (node.op == "call_function" and target in (torch.mean, torch.sum)):
        kind, axis = ins[first]
        ndim = len(shape_of(first))
        dim = _arg(node, 1, "dim")
        keepdim = _arg(node, 2, "keepdim", False)
        dims = [_norm(d, ndim) for d in (dim if isinstance(dim, (tuple, list)) else [dim])] if dim is not None else list(range(ndim))
        if axis in dims:
            raise NotSeparable(node, "reduces over the head axis" + (" (the fused heads x head_dim dim: a norm over the "
                                                                   "whole projection)" if kind == "fused" else ""))
        if not keepdim:
            raise NotSeparable(node, "reduces without keepdim=True")
        return (kind, axis)
    if node.op == "call_function" and target is operator.getitem:
        return _getitem(node, ins, out_shape)
    if node.op == "call_function" and target in _PAD:
        kind, axis = ins[first]
        padding = _arg(node, 1, "pad")
        mode = _arg(node, 2, "mode", "constant")
        if kind != "split" or mode != "constant" or axis >= len(out_shape) - len(padding) // 2:
            raise NotSeparable(node, "pads the head axis or dims before it")
        return (kind, axis)
    if node.op == "call_function" and target is torch.cat:
        tensors = node.args[0]
        ndim = len(out_shape)
        dim = _norm(_arg(node, 1, "dim", 0), ndim)
        axes = set()
        for t in tensors:
            if t not in ins:
                raise NotSeparable(node, f"concatenates {t} which is computed outside the chain")
            axes.add(ins[t])
        if len(axes) != 1:
            raise NotSeparable(node, "concatenates values with different head axes")
        kind, axis = axes.pop()
        if kind != "split" or dim == axis:
            raise NotSeparable(node, "concatenates along the head axis")
        return (kind, axis)
    if method in ("split", "chunk") or (node.op == "call_function" and target in (torch.split, torch.chunk)):
        kind, axis = ins[first]
        ndim = len(shape_of(first))
        dim = _norm(_arg(node, 2, "dim", 0), ndim)
        if kind != "split" or dim == axis:
            raise NotSeparable(node, "splits along the head axis")
        return ("tuple", axis)
    if method == "expand" or (node.op == "call_function" and target is torch.Tensor.expand):
        kind, axis = ins[first]
        in_shape = shape_of(first)
        offset = len(out_shape) - len(in_shape)
        if kind != "split" or out_shape[axis + offset] != heads:
            raise NotSeparable(node, "expands the head axis")
        form = _shape_arg_form(node, 1)
        shape_args[node] = (form, axis + offset)
        return (kind, axis + offset)
    if method in _ELEMENTWISE_METHODS or (node.op == "call_function" and target in _ELEMENTWISE_FUNCTIONS):
        return _elementwise(node, ins, out_shape, dtype_only_second=method in _DTYPE_ONLY_SECOND)
    raise NotSeparable(node, "an op the head-separability rules do not cover")


def _check_not_in_chain_except_first(node, ins):
    others = [a for a in node.all_input_nodes[1:] if a in ins]
    if others:
        raise NotSeparable(node, "its weight depends on the projection")


def _view(node, ins, heads, shape_args, out_shape) -> tuple:
    first = node.args[0]
    kind, axis = ins[first]
    in_shape = shape_of(first)
    if out_shape == in_shape:
        return (kind, axis)
    rest_in = math.prod(in_shape[axis:])
    if kind == "fused" and len(in_shape) - 1 != axis:
        raise NotSeparable(node, "reshapes a fused heads x head_dim dim that is not the last")
    if kind == "fused":  # the leading dims may merge or split too: [B, 1, s, H*D] -> (B, s, H, D)
        for at in range(len(out_shape)):
            if (out_shape[at] == heads and math.prod(out_shape[at:]) == rest_in
                    and math.prod(out_shape[:at]) == math.prod(in_shape[:axis])):
                shape_args[node] = (_shape_arg_form(node, 1), at)
                return ("split", at)
    if kind == "split":  # dims before the head axis merged or split, the head axis and after kept
        for at in range(len(out_shape)):
            if tuple(out_shape[at:]) == tuple(in_shape[axis:]) and math.prod(out_shape[:at]) == math.prod(in_shape[:axis]):
                if at != axis or tuple(out_shape[:at]) != tuple(in_shape[:axis]):
                    shape_args[node] = (_shape_arg_form(node, 1), at)
                    return ("split", at)
    if tuple(out_shape[:axis]) != tuple(in_shape[:axis]):
        raise NotSeparable(node, f"reshapes dims before the head axis ({in_shape} -> {out_shape})")
    if out_shape[axis] == heads and math.prod(out_shape[axis:]) == rest_in:
        form = _shape_arg_form(node, 1)
        shape_args[node] = (form, axis)
        return ("split", axis)
    if kind == "fused" and len(out_shape) == axis + 1:
        return ("fused", axis)
    raise NotSeparable(node, f"reshapes the head axis ({in_shape} -> {out_shape}; {heads} heads at dim {axis})")


def _getitem(node, ins, out_shape) -> tuple:
    first, index = node.args
    kind, axis = ins[first]
    if kind != "split":
        raise NotSeparable(node, "slices before the heads are split out of the projection")
    ndim = len(shape_of(first))
    index = index if isinstance(index, tuple) else (index,)
    consuming = sum(1 for i in index if i is not None and i is not Ellipsis)
    expanded = []
    for i in index:
        if i is Ellipsis:
            expanded += [slice(None)] * (ndim - consuming)
        else:
            expanded.append(i)
    in_dim, out_dim, new_axis = 0, 0, None
    for i in expanded:
        if i is None:
            out_dim += 1
            continue
        if isinstance(i, fx.Node) or not isinstance(i, (int, slice)):
            raise NotSeparable(node, "indexes with a tensor or symbolic index")
        if in_dim == axis:
            if i != slice(None):
                raise NotSeparable(node, "slices the head axis")
            new_axis = out_dim
        if isinstance(i, slice):
            out_dim += 1
        in_dim += 1
    if new_axis is None:  # the head axis lies past the index's explicit entries
        new_axis = out_dim + (axis - in_dim)
    return (kind, new_axis)


def _elementwise(node, ins, out_shape, dtype_only_second: bool) -> tuple:
    ndim = len(out_shape)
    positions = set()
    for a, (kind, axis) in ins.items():
        if dtype_only_second and a is not node.args[0]:
            continue
        positions.add((kind, axis + ndim - len(shape_of(a))))
    if len(positions) != 1:
        raise NotSeparable(node, f"combines chain values with different head axes {sorted(positions)}")
    kind, axis = positions.pop()
    operands = [a for a in node.all_input_nodes if a not in ins]
    if dtype_only_second:
        operands = [a for a in operands if a is node.args[0]]
    for a in operands:
        shape = shape_of(a)
        at = axis - (ndim - len(shape))
        if at >= 0 and shape[at] != 1:
            raise NotSeparable(node, f"{a.name} (computed outside the chain, shape {list(shape)}) is not 1 at the "
                                     f"head axis {axis}: it would differ per head")
    for a in node.args[1:]:
        if isinstance(a, torch.Tensor):
            raise NotSeparable(node, "a constant tensor operand")
    return (kind, axis)


# --- extraction -------------------------------------------------------------------------
def _replace_shape(args, kwargs, form, axis, n):
    kind, where = form
    if kind == "varargs":
        args = list(args)
        if args[where + axis] != -1:
            args[where + axis] = n
        return tuple(args), kwargs
    if kind == "tuple":
        args = list(args)
        shape = list(args[where])
        if shape[axis] != -1:
            shape[axis] = n
        args[where] = type(args[where])(shape) if isinstance(args[where], list) else tuple(shape)
        return tuple(args), kwargs
    kwargs = dict(kwargs)
    shape = list(kwargs[where])
    if shape[axis] != -1:
        shape[axis] = n
    kwargs[where] = tuple(shape)
    return args, kwargs


def extract_head_fn(chain: Chain, extras: list[fx.Node], owner: fx.GraphModule, name: str) -> fx.GraphModule:
    """``(projected, n, *extras) -> [B, n, s, D]``: the chain with the head count in its
    shape arguments replaced by ``n``; ``extras`` (shared by q, k, v) mapped by identity."""
    graph = fx.Graph()
    env: dict[fx.Node, Any] = {}
    env[chain.projection] = graph.placeholder("projected")
    n = graph.placeholder("n")
    for i, extra in enumerate(extras):
        env[extra] = graph.placeholder(f"extra_{i}_{extra.name}")
    for node in chain.nodes:
        copy = graph.node_copy(node, lambda a: env[a])
        if node in chain.shape_args:
            form, axis = chain.shape_args[node]
            copy.args, copy.kwargs = _replace_shape(copy.args, copy.kwargs, form, axis, n)
        env[node] = copy
    graph.output(env[chain.output])
    gm = fx.GraphModule(owner, graph, class_name=name)
    return gm
