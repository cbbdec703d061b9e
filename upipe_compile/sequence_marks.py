"""Run-time marks on tensors that hold this rank's shard of the sequence, read by the backend's
check for ops that mix tokens across ranks (:mod:`upipe_compile.passes.token_mixing`) when it
compiles a graph that takes them as inputs.

- :func:`mark_sequence_dim`: which dimension is the shard (set by ``shard_sequence`` and
  ``global_positions``, and on a compiled graph's outputs by :func:`marking_outputs`, so that
  the graph after a graph break starts from them);
- a routing-table mark on a graph's outputs that are token-derived expert ids (an MoE layer's
  sorted ids split off from their dispatch by a graph break, as JetMoE's ``.tolist()`` does);
- the shard lengths cut over each process group: a graph a break split off from its attention
  (a Mamba layer alone) with unmarked inputs still knows which dimension holds the tokens.
"""

from __future__ import annotations

import weakref
from typing import Callable, Optional

import torch

_SEQUENCE_DIM = "_upipe_sequence_dim"
_ROUTING_TABLE = "_upipe_routing_table"

_cut_lengths: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
"""process group -> the shard lengths cut over it (gone with the group)."""


def mark_sequence_dim(t: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """Record that ``t``'s dimension ``dim`` is this rank's shard of the sequence (and, with
    ``group``, that shards of this length are cut over it)."""
    dim %= t.dim()
    setattr(t, _SEQUENCE_DIM, dim)
    if group is not None:
        _cut_lengths.setdefault(group, set()).add(int(t.shape[dim]))
    return t


def marked_sequence_dim(t) -> Optional[int]:
    return getattr(t, _SEQUENCE_DIM, None)


def is_routing_table(t) -> bool:
    return getattr(t, _ROUTING_TABLE, False)


def cut_lengths(group) -> frozenset:
    """The shard lengths ``shard_sequence`` / ``global_positions`` cut over ``group``."""
    return frozenset(_cut_lengths.get(group, ()))


def marking_outputs(compiled: Callable, output_dims: list, routing: list = ()) -> Callable:
    """``compiled`` that marks its outputs' sequence dimensions (None: no tokens), and which of
    them are routing tables (a graph break's next graph takes them as inputs and is checked
    from them)."""
    if not any(d is not None for d in output_dims):
        return compiled
    routing = list(routing) + [False] * (len(output_dims) - len(routing))

    def run(*args):
        outputs = compiled(*args)
        for out, dim, table in zip(outputs if isinstance(outputs, (list, tuple)) else [outputs], output_dims, routing):
            if dim is not None and isinstance(out, torch.Tensor) and out.dim() > dim:
                setattr(out, _SEQUENCE_DIM, dim)
                if table:
                    setattr(out, _ROUTING_TABLE, True)
        return outputs

    return run
