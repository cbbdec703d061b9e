"""Following the sequence dimension through aten ops (:mod:`upipe_compile.passes.token_mixing`
runs it): a dispatch mode that gives each tensor holding tokens a placement on a 2-rank stand-in
mesh (``Shard(d)`` along the sequence, ``Partial`` for a sum over tokens), asks DTensor's
sharding propagation what each op needs of its inputs, and records each op that would need other
ranks' tokens (:class:`TokenMixing`); the interpreter that runs a graph, nested bodies included,
under it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

from upipe_compile.passes.context import TOKEN_MIXING_OPS, RefusedOp
from upipe_compile.passes.graph_utils import is_weight_placeholder, source_line
from upipe_compile.sequence_marks import is_routing_table, marked_sequence_dim

SEQUENCE_FIX = ("upipe runs every op but attention on this rank's shard of the sequence; run this layer "
                "without context parallelism, or express it as scaled_dot_product_attention")

_CACHE_SOURCE = "transformers/cache_utils.py"
CACHE_FIX = ("this is the cache transformers fills when use_cache is on, which would hold this rank's shard: "
             "build the model after calling upipe_compile.integrations.transformers.register(), or switch a model "
             "built before it with model.set_attn_implementation(register()) (either way it runs without a cache "
             "under context parallelism), or call it with use_cache=False")

@dataclass
class TokenMixing(RefusedOp):
    """One op that needs other ranks' tokens and that upipe did not rewrite."""

    refusal_kind = TOKEN_MIXING_OPS

    node: fx.Node
    op: str
    """The aten op that mixes (``aten.cumsum.default``, ...)."""
    why: str
    source_line: str
    reduction_line: str | None = None
    """Where the reduction over tokens was made, when that is what flows back."""

    @property
    def reason(self) -> str:
        where = f" (the reduction over tokens at {self.reduction_line})" if self.reduction_line else ""
        fix = CACHE_FIX if _CACHE_SOURCE in self.source_line else SEQUENCE_FIX
        return f"{self.op} {self.why}{where}; {fix}"


@dataclass
class Seeds:
    local_lengths: frozenset[int]
    cut_lengths: frozenset[int]
    exempt: Callable[[fx.Node], bool]
    live: set[fx.Node]
    found: list[TokenMixing] = field(default_factory=list)


def marked_dim(node: fx.Node) -> int | None:
    return marked_sequence_dim(_example(node))


def marked_routing(node: fx.Node) -> bool:
    return is_routing_table(_example(node))


def _example(node: fx.Node) -> Any:
    """The run-time tensor Dynamo traced a graph input from."""
    return getattr(node.meta.get("grapharg"), "example", None)


def _stand_in_mesh() -> DeviceMesh:
    """Two ranks, no process group: the propagator asks only about placements."""
    return DeviceMesh("cpu", torch.arange(2), _init_backend=False, _rank=0)


class SequenceTracker(TorchDispatchMode):
    """Follows token placements through aten ops (see the module docstring)."""

    def __init__(self, seeds: Seeds):
        super().__init__()
        self.seeds = seeds
        self.placement = WeakIdKeyDictionary()  # tensor -> Shard(d) | Partial
        self.span = WeakIdKeyDictionary()  # Shard(d) tensor -> (tokens, inner) when d is not tokens alone
        self.routing = WeakIdKeyDictionary()  # token-derived routing tables (sorted expert ids, offsets)
        self.routed_rows = WeakIdKeyDictionary()  # token rows in routing order -> the whole set's span
        self.partial_origin = WeakIdKeyDictionary()  # Partial tensor -> source line of its reduction
        self.mesh = _stand_in_mesh()
        self.node: fx.Node | None = None

    # -- seeds --------------------------------------------------------------------------------
    def seed(self, node: fx.Node, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        value = _fresh(value)
        dim = self._sequence_dim(node, value)
        if dim is not None:
            self.placement[value] = Shard(dim)
            if marked_routing(node):
                self.routing[value] = True
        return value

    def _sequence_dim(self, node: fx.Node, value: torch.Tensor) -> int | None:
        marked = marked_dim(node)
        if marked is not None and marked < value.dim() and value.shape[marked] > 1:
            return marked
        if marked is not None:
            return None  # one token a rank: no different from a broadcast dimension, not followed
        if is_weight_placeholder(node) or value.dim() < 2:
            return None
        if self.seeds.local_lengths:  # the query length of this graph's attention calls
            return next((d for d in range(1, value.dim()) if value.shape[d] in self.seeds.local_lengths
                         and value.shape[d] > 1), None)
        # no attention here (a graph split off by a break): hidden states [B, S, ...] of a
        # length shard_sequence cut
        return 1 if value.dim() >= 3 and value.shape[1] > 1 and value.shape[1] in self.seeds.cut_lengths else None

    def mark(self, t: Any, placement, span: tuple[int, int] | None = None) -> None:
        if isinstance(t, torch.Tensor) and placement is not None:
            self.placement[t] = placement
            if span is not None:
                self.span[t] = span

    def get(self, t: Any):
        return self.placement.get(t) if isinstance(t, torch.Tensor) else None

    # -- dispatch -----------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flat, _ = tree_flatten((args, kwargs))
        if not any(self.get(t) is not None for t in flat):
            return out
        if not any(isinstance(t, torch.Tensor) for t in tree_flatten(out)[0]):
            return out  # metadata (device, sizes): nothing per token
        if func in _VIEW_ALIASES:  # shape-only: the placement moves with the view
            self._follow_view(func, args, out)
            self._keep_routing_order(flat, out)
            return out
        tokens = [t for t in flat if isinstance(self.get(t), Shard)]
        if tokens and all(t in self.routing for t in tokens):
            self._mark_routing(out, tokens[0])  # routing in, routing out (counts, offsets, ...)
            return out
        if not tokens:
            # rank-local aggregates only (a loss, an aux loss, a metric): still an aggregate,
            # refused only where it flows back into per-token values
            origin = next((self.partial_origin.get(t) for t in flat if isinstance(self.get(t), Partial)), None)
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.mark(t, Partial())
                    self.partial_origin[t] = origin
            return out
        self._propagate(func, args, kwargs, out)
        self._keep_routing_order(flat, out)
        return out

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

    def _follow_view(self, func, args, out) -> None:
        source = args[0]
        placement = self.get(source)
        if placement is None or not isinstance(out, torch.Tensor):
            return
        if isinstance(placement, Partial):
            self.mark(out, placement)
            self.partial_origin[out] = self.partial_origin.get(source)
            return
        if out.dim() == source.dim() and tuple(out.shape) == tuple(source.shape):
            self.mark(out, placement, self.span.get(source))
            return
        size, inner = self.span.get(source) or (source.shape[placement.dim], 1)
        moved = _view_dim(tuple(source.shape), tuple(out.shape), placement.dim, size, inner)
        if moved is not None:
            dim, span = moved
            self.mark(out, Shard(dim), span)

    def _same_shard_elementwise(self, args, out) -> bool:
        """An elementwise op over tensors of ``out``'s shape: each output element reads its
        inputs' same element, so ``out`` is sharded as they are (when they all agree)."""
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        placements = {self.get(t) for t in tensors} - {None}
        if not isinstance(out, torch.Tensor) or any(tuple(t.shape) != tuple(out.shape) for t in tensors) \
                or len(placements) != 1 or not isinstance(next(iter(placements)), Shard):
            return False
        sharded = next(t for t in tensors if self.get(t) is not None)
        self.mark(out, self.get(sharded), self.span.get(sharded))
        return True

    def _propagate(self, func, args, kwargs, out) -> None:
        if func.namespace == "upipe":
            if func.overloadpacket is torch.ops.upipe.head_mixer:
                self.found(func, "is a mixer over the sequence that was not rewritten into its stage loop")
                return
            self._own_op(args, kwargs, out)
            return
        if func in _CONVOLUTIONS and isinstance(self.get(args[0]), Shard) and self.get(args[0]).dim >= 2:
            # some torch releases keep a convolution's spatial dimension sharded: DTensor's
            # own handler then exchanges a halo with the neighbouring ranks, which this shard
            # would not get
            self.found(func, f"needs other ranks' tokens (a convolution over sequence dimension "
                             f"{self.get(args[0]).dim})")
            return
        if func is _aten.constant_pad_nd.default and isinstance(self.get(args[0]), Shard):
            # torch < 2.13 has no sharding rule that keeps an unpadded dimension sharded; a pad
            # of other dimensions only (the head dim, as MLA's) stays on this rank's tokens
            dim = self.get(args[0]).dim
            if not _pads_dim(args[1], args[0].dim(), dim):
                self.mark(out, Shard(dim), self.span.get(args[0]))
                return
        if func in _ELEMENTWISE_WITHOUT_RULE and self._same_shard_elementwise(args, out):
            return
        if self._regrouped_rows(func, args, kwargs, out):
            return
        to_dtensor = self._wrapper()
        self.partial_origin_by_spec = {}
        self.spec_tensor = {}
        try:
            d_args, d_kwargs = tree_map(to_dtensor, (args, kwargs))
            op_info = DTensor._op_dispatcher.unwrap_to_op_info(func, d_args, d_kwargs)
            DTensor._op_dispatcher.sharding_propagator.propagate(op_info)
        except Exception as error:  # no sharding rule: refuse rather than guess
            routed = any(t in self.routing for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor))
            if routed and (_is_grouped_mm(func) or func.overloadpacket in _ROW_ROUTING):
                self._mark_rows(func, out, args, kwargs)  # rows moved by a routing table (no rule in this torch)
                return
            first = str(error).strip().splitlines()[0][:160] if str(error).strip() else type(error).__name__
            self.found(func, f"takes this rank's tokens and torch has no sharding rule to tell whether it "
                              f"mixes them ({first})")
            return
        sharding = op_info.output_sharding
        if sharding.needs_redistribute and sharding.redistribute_schema is not None:
            verdict = self._mixes(func, op_info.schema, sharding.redistribute_schema)
            if verdict == "refused":
                return
            if verdict == "routing":
                first = next(t for t in tree_flatten((args, kwargs))[0] if isinstance(self.get(t), Shard))
                self._mark_routing(out, first)
                return
            if verdict == "rows":
                self._mark_rows(func, out, args, kwargs)
                return
        self._record_outputs(func, args, kwargs, out, sharding.output_spec)

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

    def _wrapper(self):
        mesh = self.mesh

        def to_dtensor(t):
            if not isinstance(t, torch.Tensor) or isinstance(t, DTensor):
                return t
            placement = self.get(t) or Replicate()
            spec = DTensorSpec(mesh, (placement,), tensor_meta=TensorMeta(t.shape, t.stride(), t.dtype))
            if isinstance(placement, Partial):
                self.partial_origin_by_spec[id(spec)] = self.partial_origin.get(t)
            self.spec_tensor[id(spec)] = t
            return DTensor(t.detach(), spec, requires_grad=False)

        return to_dtensor

    def _mixes(self, func, schema, wanted) -> str | None:
        """What an op the propagator would redistribute does: ``"refused"`` (reported),
        ``"routing"`` (integer token data such as expert ids sorted on this shard: a routing
        table, not a value), ``"rows"`` (token rows gathered or scattered by a routing table:
        the MoE dispatch and combine) or None (nothing token-held moves)."""
        changed = [(have, want.placements[0]) for have, want in zip(schema.args_spec, wanted.args_spec)
                   if have.placements[0] != want.placements[0] and not isinstance(have.placements[0], Replicate)]
        if not changed:
            return None
        # a sum or mean over tokens next to per-token values: whichever side the propagator
        # would move, the reduction is what needs the other ranks
        partial = next((have for have in schema.args_spec if isinstance(have.placements[0], Partial)), None)
        if partial is not None:
            self.found(func, "uses a sum or mean over the sequence as a per-token value",
                       reduction_line=self.partial_origin_by_spec.get(id(partial)))
            return "refused"
        values = [(have, needs) for have, needs in changed if not self._is_routing_data(self.spec_tensor.get(id(have)))]
        routed = any(self.spec_tensor.get(id(spec)) in self.routing for spec in schema.args_spec)
        if not values and (routed or func.overloadpacket in _ROUTING_SOURCES):
            return "routing"
        if not values:  # integer token data mixed otherwise: positions from a cumsum of the mask, ...
            values = changed
        if routed and func.overloadpacket in _ROW_ROUTING:
            return "rows"
        have, needs = values[0]
        self.found(func, f"needs other ranks' tokens (its sequence dimension {have.placements[0].dim} cannot "
                         f"stay sharded: it would be {_placement_name(needs)})")
        return "refused"

    def _is_routing_data(self, t) -> bool:
        """A routing table already, or integer/bool token data (ids, positions, masks)."""
        return t is not None and (t in self.routing or not (t.is_floating_point() or t.is_complex()))

    def _own_op(self, args, kwargs, out) -> None:
        """upipe's own ops (attention, tiled MLP, chunked loss, offload) are written for this
        layout: an output shaped like a token input holds its tokens, a smaller one (a loss)
        is this rank's part of a sum."""
        token = next(t for t in tree_flatten((args, kwargs))[0] if isinstance(self.get(t), Shard))
        dim = self.get(token).dim
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            if t.dim() > dim and t.shape[dim] == token.shape[dim]:
                self.mark(t, Shard(dim), self.span.get(token))
            else:
                self.mark(t, Partial())
                self.partial_origin[t] = self._line()

    def _mark_routing(self, out, like) -> None:
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
        func_gathers = func.overloadpacket in _ROW_GATHERS or (_is_grouped_mm(func) and rows in self.routed_rows)
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

    def _record_outputs(self, func, args, kwargs, out, spec) -> None:
        outs, _ = tree_flatten(out)
        specs = spec if isinstance(spec, (list, tuple)) else [spec]
        specs, _ = tree_flatten(list(specs), is_leaf=lambda s: isinstance(s, DTensorSpec) or s is None)
        tensors = [t for t in outs if isinstance(t, torch.Tensor)]
        inputs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        origins = [self.partial_origin.get(a) for a in inputs if isinstance(self.get(a), Partial)]
        for t, s in zip(tensors, specs):
            if not isinstance(s, DTensorSpec):
                continue
            placement = s.placements[0]
            if isinstance(placement, Replicate):
                continue
            if isinstance(placement, Partial):
                self.mark(t, placement)
                self.partial_origin[t] = next(iter(origins), None) or self._line()
                continue
            span = next((self.span.get(a) for a in inputs if self.get(a) == placement
                         and a.dim() == t.dim() and a.shape[placement.dim] == t.shape[placement.dim]), None)
            self.mark(t, placement, span)
        # an in-place op's first argument is its output
        if func._schema.is_mutable and args and isinstance(args[0], torch.Tensor) and tensors:
            placement = self.get(tensors[0])
            if placement is not None:
                self.mark(args[0], placement)

    def found_failure(self, error: Exception) -> None:
        text = (str(error).strip().splitlines() or [type(error).__name__])[0][:160]
        self.found(self.node.target if self.node is not None else "?",
                    f"could not be followed along the sequence by upipe's check ({type(error).__name__}: {text}); "
                    "please report it")

    def found(self, func, why: str, reduction_line: str | None = None) -> None:
        node = self.node
        if node is None or node not in self.seeds.live:
            return  # dead code (transformers' packed-sequence probe whose mask goes unused): harmless
        self.seeds.found.append(TokenMixing(node, str(func), why, self._line(), reduction_line))

    def _line(self) -> str:
        return source_line(self.node) if self.node is not None else "<unknown>"


def _pads_dim(pad: list[int], ndim: int, dim: int) -> bool:
    """Whether ``constant_pad_nd``'s ``pad`` (pairs from the last dimension back) pads ``dim``."""
    pair = 2 * (ndim - 1 - dim)
    return any(p != 0 for p in pad[pair:pair + 2])


def _placement_name(p) -> str:
    return "replicated (all-gathered)" if isinstance(p, Replicate) else f"sharded on dimension {p.dim}"


_aten = torch.ops.aten
_ROW_ROUTING = {
    _aten.index, _aten.index_select, _aten.gather, _aten.index_add, _aten.index_add_, _aten.index_put,
    _aten.index_put_, _aten.index_copy, _aten.index_copy_, _aten.scatter, _aten.scatter_, _aten.scatter_add,
    _aten.scatter_add_, _aten.scatter_reduce, _aten.scatter_reduce_, _aten._grouped_mm,
    _aten.masked_select, _aten.masked_scatter, _aten.masked_scatter_,
}

"""Ops that move rows by an index: with a routing table as the index (an MoE layer's
dispatch and combine on this shard's tokens) they keep each token's values its own."""
_ROW_GATHERS = {_aten.index, _aten.index_select, _aten.gather, _aten.masked_select}
"""Of those, the ones whose result is rows in routing order (the dispatch, not the combine)."""
_ROW_GROUPING = {_aten.split, _aten.split_with_sizes, _aten.cat}
_ROW_PRODUCTS = {_aten.mm, _aten.addmm}
"""An expert's projection of its group of rows."""
"""Ops that cut rows in routing order into their experts' groups or join the groups."""
_ROUTING_SOURCES = {_aten.sort, _aten.argsort}
"""Integer token data (expert ids) sorted on this shard: an MoE dispatch's routing table. Any
other op that mixes integer token data (positions from a cumsum over the shard's mask) is
refused like any value."""


def _is_grouped_mm(func) -> bool:
    """A grouped matmul registered by a library (transformers' fallback of torch's
    ``_grouped_mm``): one weight per group of rows, each row on its own."""
    return func.__name__.split(".")[0].endswith("grouped_mm") or "grouped_mm_fallback" in str(func)


_CONVOLUTIONS = {_aten.convolution.default, _aten.convolution_backward.default}
_ELEMENTWISE_WITHOUT_RULE = {_aten.polar.default, _aten.complex.default}
"""Elementwise ops DTensor has no sharding rule for (torch 2.13): complex numbers from two
real tensors of one shape (a RoPE table's rows from their angles)."""
_VIEW_ALIASES = {
    _aten.view.default, _aten._unsafe_view.default, _aten.reshape.default, _aten.alias.default,
    _aten.view.dtype, _aten.lift_fresh.default, _aten.detach.default,
}


def _view_dim(src: tuple, dst: tuple, dim: int, size: int, inner: int) -> tuple[int, tuple[int, int]] | None:
    """Where the tokens of a ``src``-shaped tensor's dimension ``dim`` land in its ``dst``-shaped
    view, and their span there: along a dimension, the token index is ``(i // inner) % size``.
    Dimensions that merge keep the tokens with the inner dimensions' product as ``inner`` (tokens
    flattened with the batch); a dimension that splits puts them in the piece holding the
    tokens' fastest-varying factor."""
    groups = _view_groups(src, dst)
    for src_dims, dst_dims in groups:
        if dim not in src_dims:
            continue
        # the token factor's stride within the merged group
        after = 1
        for d in src_dims[src_dims.index(dim) + 1:]:
            after *= src[d]
        low = inner * after  # the stride of the token index within the group
        stride = 1
        for d in reversed(dst_dims):
            if stride <= low < stride * dst[d] and dst[d] != 1:
                return d, (size, low // stride)
            stride *= dst[d]
        return None
    return None


def _view_groups(src: tuple, dst: tuple) -> list[tuple[list[int], list[int]]]:
    """The smallest runs of ``src`` and ``dst`` dimensions with equal products (a view merges
    and splits within such runs); size-1 dimensions join the run before them."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(src) or j < len(dst):
        src_dims, dst_dims = [], []
        src_prod = dst_prod = 1
        while True:
            if i < len(src) and (src_prod < dst_prod or not src_dims or (j == len(dst) and src_prod == dst_prod)):
                src_prod *= src[i]
                src_dims.append(i)
                i += 1
            elif j < len(dst) and (dst_prod < src_prod or not dst_dims):
                dst_prod *= dst[j]
                dst_dims.append(j)
                j += 1
            else:
                break
            if src_prod == dst_prod and src_dims and dst_dims:
                # size-1 dimensions that follow belong to this run
                while i < len(src) and src[i] == 1 and (j >= len(dst) or dst[j] != 1):
                    src_dims.append(i)
                    i += 1
                while j < len(dst) and dst[j] == 1 and (i >= len(src) or src[i] != 1):
                    dst_dims.append(j)
                    j += 1
                break
            if i >= len(src) and j >= len(dst):
                break
        groups.append((src_dims, dst_dims))
    return groups


def _fresh(value: torch.Tensor) -> torch.Tensor:
    """A tensor of the same fake mode, shape, stride and dtype (the graph's own example value
    must not carry our placements)."""
    return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)


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
