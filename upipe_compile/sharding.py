"""Sequence shards for context parallelism, and their global positions.

One dimension (a 1-D mesh or a process group): rank r of P holds tokens
``[r * S/P, (r + 1) * S/P)``. Ulysses and UPipe need exactly this layout (no head-tail load
balancing) and equal shard lengths.

Ring x all-to-all (a 2-D mesh named ``("cp_ring", "cp_a2a")``): ring rank rho holds the
zigzag chunks rho and 2R - 1 - rho of 2R (:mod:`upipe_compile.attention.ring`), and its A
all-to-all ranks split that share contiguously, so that the all-to-all gathers exactly the
ring rank's share.
"""

from __future__ import annotations

import torch
from upipe_compile.attention.collectives import all_gather, resolve_groups
from upipe_compile.attention.zigzag import zigzag_shard, zigzag_unshard
from upipe_compile.errors import UnsupportedAttention
from upipe_compile.sequence_marks import mark_sequence_dim


def sequence_multiple(cp: int, ring_degree: int = 1) -> int:
    """What every sequence length must be a multiple of: P equal shards, or with a ring each of
    the R ring ranks' two zigzag chunks split over its P / R all-to-all ranks (2P). The one
    statement of the rule; the trainers, the torchtitan checks and the estimate ask it."""
    return cp * (2 if ring_degree > 1 else 1)


def shard_sequence(t: torch.Tensor, cp_mesh=None, dim: int = 1) -> torch.Tensor:
    """This rank's shard of ``t`` along ``dim`` (the full sequence is the same on every
    rank). Refuses lengths the layout cannot cut evenly."""
    group, ring_group = resolve_groups(cp_mesh)
    world, length = group.size(), t.shape[dim]
    ring = 1 if ring_group is None else ring_group.size()
    pieces = sequence_multiple(world * ring, ring)
    if length % pieces:
        layout = (f"the context-parallel size {world}" if ring_group is None else
                  f"2 x ring degree {ring} x all-to-all degree {world} (two zigzag chunks per ring rank)")
        raise UnsupportedAttention(f"sequence length {length} (dim {dim}) is not divisible by {layout}; "
                                   f"pad it to a multiple of {pieces}")
    if ring_group is not None:
        t = zigzag_shard(t, ring_group.rank(), ring, dim)
    share = t.shape[dim] // world
    # the backend follows this dimension through the graph to refuse ops that mix tokens
    return mark_sequence_dim(t.narrow(dim, group.rank() * share, share), dim, group)


def gather_sequence(t: torch.Tensor, cp_mesh=None, dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's shard (all-gathers along ``dim``)."""
    group, ring_group = resolve_groups(cp_mesh)
    if group.size() > 1:
        t = all_gather(t, group, dim)
    if ring_group is None:
        return t
    return zigzag_unshard(list(all_gather(t, ring_group, dim).chunk(ring_group.size(), dim=dim)), dim)


def global_positions(local_length: int, cp_mesh=None, device=None) -> torch.Tensor:
    """Position ids ``[1, local_length]`` of this rank's shard within the full sequence
    (feed them to RoPE so that a shard is rotated as in the unsharded model)."""
    group, ring_group = resolve_groups(cp_mesh)
    if ring_group is None:
        start = group.rank() * local_length
        return mark_sequence_dim(torch.arange(start, start + local_length, device=device).unsqueeze(0), 1, group)
    full = torch.arange(local_length * group.size() * ring_group.size(), device=device).unsqueeze(0)
    return shard_sequence(full, cp_mesh, dim=1)
