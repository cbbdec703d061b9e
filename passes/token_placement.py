"""Following the sequence dimension through aten ops (:mod:`upipe_compile.passes.token_mixing`
runs it): a dispatch mode that gives each tensor holding tokens a placement on a 2-rank stand-in
mesh (``Shard(d)`` along the sequence, ``Partial`` for a sum over tokens), asks DTensor's
sharding propagation what each op needs of its inputs, and records each op that would need other
ranks' tokens (:class:`~upipe_compile.passes.token_mixing_refusal.TokenMixing`). Its MoE routing
rules are in :mod:`upipe_compile.passes.token_routing`, where tokens go through a view in
:mod:`upipe_compile.passes.token_views`; :mod:`upipe_compile.passes.token_walk` runs a graph
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

from upipe_compile.passes.graph_utils import is_weight_placeholder, source_line
from upipe_compile.passes.token_mixing_refusal import TokenMixing
from upipe_compile.passes.token_routing import ROUTING_SOURCES, ROW_ROUTING, RoutingRules, is_grouped_mm
from upipe_compile.passes.token_views import VIEW_ALIASES, view_dim
from upipe_compile.sequence_marks import is_routing_table, marked_sequence_dim


@dataclass
class Seeds:
    """What the walk starts from (the lengths that tell a token dimension, the calls upipe rewrites,
    the nodes whose values are used) and what it found."""

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


class SequenceTracker(RoutingRules, TorchDispatchMode):
    """Follows token placements through aten ops (see the module docstring)."""

    def __init__(self, seeds: Seeds):
        super().__init__()
        self.seeds = seeds
        self.placement = WeakIdKeyDictionary()  # tensor -> Shard(d) | Partial
        self.span = WeakIdKeyDictionary()  # Shard(d) tensor -> (tokens, inner) when d is not tokens alone
        self.partial_origin = WeakIdKeyDictionary()  # Partial tensor -> source line of its reduction
        # the op being propagated: id(its DTensorSpec) -> its Partial input's reduction line, its tensor
        self.partial_origin_by_spec: dict[int, str | None] = {}
        self.spec_tensor: dict[int, torch.Tensor] = {}
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
        if func in VIEW_ALIASES:  # shape-only: the placement moves with the view
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
        moved = view_dim(tuple(source.shape), tuple(out.shape), placement.dim, size, inner)
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
        self.partial_origin_by_spec.clear()
        self.spec_tensor.clear()
        try:
            d_args, d_kwargs = tree_map(to_dtensor, (args, kwargs))
            op_info = DTensor._op_dispatcher.unwrap_to_op_info(func, d_args, d_kwargs)
            DTensor._op_dispatcher.sharding_propagator.propagate(op_info)
        except Exception as error:  # no sharding rule: refuse rather than guess
            routed = any(t in self.routing for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor))
            if routed and (is_grouped_mm(func) or func.overloadpacket in ROW_ROUTING):
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
        if not values and (routed or func.overloadpacket in ROUTING_SOURCES):
            return "routing"
        if not values:  # integer token data mixed otherwise: positions from a cumsum of the mask, ...
            values = changed
        if routed and func.overloadpacket in ROW_ROUTING:
            return "rows"
        have, needs = values[0]
        self.found(func, f"needs other ranks' tokens (its sequence dimension {have.placements[0].dim} cannot "
                         f"stay sharded: it would be {_placement_name(needs)})")
        return "refused"

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
_CONVOLUTIONS = {_aten.convolution.default, _aten.convolution_backward.default}
_ELEMENTWISE_WITHOUT_RULE = {_aten.polar.default, _aten.complex.default}
"""Elementwise ops DTensor has no sharding rule for (torch 2.13): complex numbers from two
real tensors of one shape (a RoPE table's rows from their angles)."""


def _fresh(value: torch.Tensor) -> torch.Tensor:
    """A tensor of the same fake mode, shape, stride and dtype (the graph's own example value
    must not carry our placements)."""
    return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)
