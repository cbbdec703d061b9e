"""The MoE routing rules of :class:`~upipe_compile.passes.token_placement.SequenceTracker`: a sort
of integer token data (expert ids) on this shard makes a routing table, and rows of token values
moved by one (gathered, scattered, grouped-matmul'd: an MoE layer's dispatch and combine) stay
this shard's tokens; rows gathered in routing order may be split into their experts' groups,
projected group by group and concatenated back (JetMoE). Each row stays one token's own."""

from __future__ import annotations

import torch
from torch.distributed.tensor.placement_types import Partial, Shard
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

_aten = torch.ops.aten
ROW_ROUTING = frozenset({
    _aten.index, _aten.index_select, _aten.gather, _aten.index_add, _aten.index_add_, _aten.index_put,
    _aten.index_put_, _aten.index_copy, _aten.index_copy_, _aten.scatter, _aten.scatter_, _aten.scatter_add,
    _aten.scatter_add_, _aten.scatter_reduce, _aten.scatter_reduce_, _aten._grouped_mm,
    _aten.masked_select, _aten.masked_scatter, _aten.masked_scatter_,
})
"""Ops that move rows by an index: with a routing table as the index (an MoE layer's
dispatch and combine on this shard's tokens) they keep each token's values its own."""
_ROW_GATHERS = {_aten.index, _aten.index_select, _aten.gather, _aten.masked_select}
"""Of those, the ones whose result is rows in routing order (the dispatch, not the combine)."""
_ROW_GROUPING = {_aten.split, _aten.split_with_sizes, _aten.cat}
"""Ops that cut rows in routing order into their experts' groups or join the groups."""
_ROW_PRODUCTS = {_aten.mm, _aten.addmm}
"""An expert's projection of its group of rows."""
ROUTING_SOURCES = frozenset({_aten.sort, _aten.argsort})
"""Integer token data (expert ids) sorted on this shard: an MoE dispatch's routing table. Any
other op that mixes integer token data (positions from a cumsum over the shard's mask) is
refused like any value."""


def is_grouped_mm(func) -> bool:
    """A grouped matmul registered by a library (transformers' fallback of torch's
    ``_grouped_mm``): one weight per group of rows, each row on its own."""
    return func.__name__.split(".")[0].endswith("grouped_mm") or "grouped_mm_fallback" in str(func)


class RoutingRules:
    """The routing half of the tracker (a mixin of
    :class:`~upipe_compile.passes.token_placement.SequenceTracker`, whose ``get``, ``mark`` and
    ``span`` it uses): which tensors are routing tables and which hold token rows in routing order."""

    def __init__(self):
        super().__init__()
        self.routing = WeakIdKeyDictionary()  # token-derived routing tables (sorted expert ids, offsets)
        self.routed_rows = WeakIdKeyDictionary()  # token rows in routing order -> the whole set's span

    def _keep_routing_order(self, inputs, out) -> None:
        """An op on rows in routing order alone (an expert's projection, its gate) that keeps
        them sharded along the same dimension gives rows in that order too."""
        rows = [t for t in inputs if isinstance(self.get(t), Shard)]
        if not rows or not all(t in self.routed_rows for t in rows):
            return
        dims = {self.get(t).dim for t in rows}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and isinstance(p := self.get(t), Shard) and p.dim in dims:
                self._mark_routed(t, p, self.routed_rows[rows[0]])

    def _regrouped_rows(self, func, args, kwargs, out) -> bool:
        """Rows in routing order split into their experts' groups (sizes counted from this
        shard's routing) or the groups concatenated back, along the rows' dimension: each row
        stays one token's own (an MoE layer's experts run one group each, as JetMoE's do)."""
        if func.overloadpacket in _ROW_PRODUCTS:
            # rows times a weight, row by row (DTensor asks for a gather when a group holds
            # fewer rows than its stand-in mesh has ranks)
            rows, weight = (args[0], args[1]) if func.overloadpacket is _aten.mm else (args[1], args[2])
            placement = self.get(rows)
            if rows not in self.routed_rows or placement != Shard(0) or self.get(weight) is not None \
                    or (func.overloadpacket is _aten.addmm and self.get(args[0]) is not None):
                return False
            self._mark_routed(out, placement, self.routed_rows[rows])
            return True
        if func.overloadpacket not in _ROW_GROUPING:
            return False
        pieces = args[0] if func.overloadpacket is _aten.cat else [args[0]]
        dim = (kwargs.get("dim", args[1] if func.overloadpacket is _aten.cat and len(args) > 1 else
                          args[2] if len(args) > 2 else 0))
        tokens = [t for t in pieces if isinstance(self.get(t), Shard)]
        if not tokens or not all(t in self.routed_rows and self.get(t).dim == dim % t.dim() for t in tokens):
            return False
        whole = self.routed_rows[tokens[0]]
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._mark_routed(t, Shard(dim % t.dim()), whole)
        return True

    def _mark_routed(self, t: torch.Tensor, placement: Shard, whole: tuple[int, int] | None) -> None:
        """``t`` holds token rows in routing order, all of them (its span is the whole set's)
        or a group of them."""
        complete = whole is not None and t.shape[placement.dim] == whole[0] * whole[1]
        self.mark(t, placement, whole if complete else None)
        self.routed_rows[t] = whole

    def _is_routing_data(self, t) -> bool:
        """A routing table already, or integer/bool token data (ids, positions, masks)."""
        return t is not None and (t in self.routing or not (t.is_floating_point() or t.is_complex()))

    def _mark_routing(self, out, like) -> None:
        """``out``, made from routing tables alone (counts, offsets), is routing too."""
        placement = self.get(like)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.mark(t, Shard(min(placement.dim, max(t.dim() - 1, 0))) if t.dim() else Partial())
                if t.dim():
                    self.routing[t] = True

    def _mark_rows(self, func, out, args, kwargs) -> None:
        """Rows of token values moved by a routing table stay token rows (in routing order
        where the op gathers them, or a grouped matmul keeps that order)."""
        rows = next(t for t in tree_flatten((args, kwargs))[0]
                    if isinstance(self.get(t), Shard) and t not in self.routing and t.is_floating_point())
        func_gathers = func.overloadpacket in _ROW_GATHERS or (is_grouped_mm(func) and rows in self.routed_rows)
        dim = self.get(rows).dim
        size, inner = self.span.get(rows) or self.routed_rows.get(rows) or (rows.shape[dim], 1)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.dim() > dim:
                # k rows per token (top-k expert slots) keep the token as the outer factor
                repeat = t.shape[dim] // (size * inner) if t.shape[dim] % (size * inner) == 0 else 0
                span = (size, inner * repeat) if repeat else None
                if func_gathers:
                    self._mark_routed(t, Shard(dim), span)
                else:
                    self.mark(t, Shard(dim), span)
