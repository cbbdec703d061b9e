"""The FX interpreter that runs a graph under :class:`~upipe_compile.passes.token_placement.SequenceTracker`
(:mod:`upipe_compile.passes.token_mixing` starts it): node by node, telling the tracker which node
runs; the bodies of checkpointing, wrap, invoke_subgraph and autograd Functions are walked in
place; the calls upipe rewrites run without asking; other higher-order ops that take tokens
are refused."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch.distributed.tensor.placement_types import Shard
from torch.utils._pytree import tree_flatten

from upipe_compile.passes.token_placement import SequenceTracker


class Walker(fx.Interpreter):
    """Runs the graph node by node (nested bodies too), telling the tracker which node runs."""

    def __init__(self, gm: fx.GraphModule, tracker: SequenceTracker):
        super().__init__(gm, garbage_collect_values=True)
        self.tracker = tracker

    def run_node(self, node: fx.Node) -> Any:
        self.tracker.node = node
        if node.op in ("call_function", "call_method") and self.tracker.seeds.exempt(node):
            return self._exempt(node)
        if node.op == "call_function" and node.target is torch._C._set_grad_enabled:
            return None  # the walk stays without autograd
        if node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator):
            body = self._body(node)
            return self._opaque(node) if body is None else self._run_body(node, body)
        return super().run_node(node)

    def _opaque(self, node: fx.Node) -> Any:
        """Another higher-order op (flex_attention, ...): run untracked; one that takes tokens
        cannot be followed and is refused."""
        args, kwargs = self.fetch_args_kwargs_from_env(node)
        if any(self.tracker.get(t) is not None for t in tree_flatten((args, kwargs))[0]):
            self.tracker.found(node.target, "takes this rank's tokens and upipe cannot follow them through it")
        with _paused():
            return super().run_node(node)

    def _exempt(self, node: fx.Node) -> Any:
        """A call upipe rewrites: run it without asking, its outputs hold the tokens of its
        first tensor (the query; a mixer's first input, laid out like its output)."""
        args, kwargs = self.fetch_args_kwargs_from_env(node)
        query = next(t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor))
        placement = self.tracker.get(query)
        with _paused():
            out = getattr(self, node.op)(node.target, args, kwargs)
        tracker = self.tracker
        for t in tree_flatten(out)[0]:  # the output, and the log-sum-exp without head_dim
            if isinstance(t, torch.Tensor) and isinstance(placement, Shard) and placement.dim < t.dim() <= query.dim():
                tracker.mark(t, placement)
        return out

    def _body(self, node: fx.Node):
        """``(body node, operands)`` of a higher-order op that calls one body on its operands
        (checkpointing, wrap, invoke_subgraph; an autograd Function's forward), else None."""
        if node.target not in _BODY_CALLS:
            return None  # flex_attention's score_mod is no body over the operands
        bodies = [i for i, a in enumerate(node.args) if isinstance(a, fx.Node) and a.op == "get_attr"
                  and isinstance(self.fetch_attr(a.target), fx.GraphModule)]
        if not bodies or (len(bodies) > 1 and node.target is not _AUTOGRAD_FUNCTION):
            return None
        operands = [a for a in node.args[bodies[-1] + 1:] if not isinstance(a, str)]
        body = self.fetch_attr(node.args[bodies[0]].target)
        if len(body.graph.find_nodes(op="placeholder")) != len(operands):
            return None
        return body, operands

    def _run_body(self, node: fx.Node, found) -> Any:
        body, operands = found
        env_args = self.map_nodes_to_values(tuple(operands), node)
        out = Walker(body, self.tracker).run(*env_args)
        self.tracker.node = node
        if node.target is _AUTOGRAD_FUNCTION:
            return out[0]  # an autograd Function's forward body returns (its output, what it saves)
        return out


_AUTOGRAD_FUNCTION = getattr(torch.ops.higher_order, "autograd_function_apply", None)
_BODY_CALLS = {getattr(torch.ops.higher_order, name, None) for name in (
    "tag_activation_checkpoint", "wrap", "invoke_subgraph", "wrap_with_set_grad_enabled", "wrap_with_autocast",
    "autograd_function_apply")} - {None}
"""Higher-order ops that call a body on their operands: the body is walked in place."""


def _paused():
    """Leave the tracker's mode (the top of the stack) while an exempt call runs."""
    return torch.utils._python_dispatch._pop_mode_temporarily()
