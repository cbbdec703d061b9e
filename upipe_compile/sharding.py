"""Contiguous sequence shards for context parallelism, and their global positions.

Rank r of P holds tokens ``[r * S/P, (r + 1) * S/P)``. Ulysses and UPipe need exactly this
layout (no head-tail load balancing) and equal shard lengths.
"""

from __future__ import annotations

import torch
from upipe_compile.attention.collectives import all_gather, resolve_group
from upipe_compile.errors import UnsupportedAttention


def _rank_and_size(cp_mesh):
    group = resolve_group(cp_mesh)
    return group, group.rank(), group.size()


def shard_sequence(t: torch.Tensor, cp_mesh=None, dim: int = 1) -> torch.Tensor:
    """This rank's contiguous shard of ``t`` along ``dim`` (the full sequence is the same on
    every rank). Refuses lengths that P does not divide."""
    _, rank, world = _rank_and_size(cp_mesh)
    length = t.shape[dim]
    if length % world:
        raise UnsupportedAttention(
            f"sequence length {length} (dim {dim}) is not divisible by the context-parallel size {world}; "
            f"pad it to a multiple of {world}"
        )
    return t.narrow(dim, rank * (length // world), length // world)


def gather_sequence(t: torch.Tensor, cp_mesh=None, dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's shard (an all-gather along ``dim``)."""
    group, _, world = _rank_and_size(cp_mesh)
    if world == 1:
        return t
    return all_gather(t, group, dim)


def global_positions(local_length: int, cp_mesh=None, device=None) -> torch.Tensor:
    """Position ids ``[1, local_length]`` of this rank's shard within the full sequence
    (feed them to RoPE so that a shard is rotated as in the unsharded model)."""
    _, rank, _ = _rank_and_size(cp_mesh)
    start = rank * local_length
    return torch.arange(start, start + local_length, device=device).unsqueeze(0)
