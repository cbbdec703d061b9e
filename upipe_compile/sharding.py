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

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from upipe_compile.attention.collectives import all_gather, resolve_groups
from upipe_compile.attention.zigzag import zigzag_shard, zigzag_unshard
from upipe_compile.errors import UnsupportedAttention
from upipe_compile.sequence_marks import mark_sequence_dim


def sequence_multiple(cp: int, ring_degree: int = 1) -> int:
    """What every sequence length must be a multiple of: P equal shards, or with a ring each of
    the R ring ranks' two zigzag chunks split over its P / R all-to-all ranks (2P). The one
    statement of the rule; the trainers, the torchtitan checks and the estimate ask it."""
    return cp * (2 if ring_degree > 1 else 1)


@dataclass(frozen=True)
class Layout:
    """How the full sequence lies over the context-parallel ranks: contiguous over one
    all-to-all group, or zigzag over a ring of all-to-all groups (module docstring). It shards,
    gathers, gives the global positions of a shard and states its own length rule."""

    group: dist.ProcessGroup
    """The all-to-all group (P ranks, or A with a ring)."""
    ring_group: Optional[dist.ProcessGroup] = None

    @classmethod
    def of(cls, cp_mesh=None) -> "Layout":
        """The layout of a 1-D mesh or process group (None: the default group), or of a 2-D
        ``("cp_ring", "cp_a2a")`` mesh."""
        return cls(*resolve_groups(cp_mesh))

    @property
    def ring_degree(self) -> int:
        return 1 if self.ring_group is None else self.ring_group.size()

    @property
    def ranks(self) -> int:
        return self.group.size() * self.ring_degree

    @property
    def multiple(self) -> int:
        return sequence_multiple(self.ranks, self.ring_degree)

    def length_problem(self, length: int, where: str = "") -> Optional[str]:
        """Why ``length`` cannot be laid out (None: it can); ``where`` follows the length."""
        if length % self.multiple == 0:
            return None
        cut = (f"the context-parallel size {self.group.size()}" if self.ring_group is None else
               f"2 x ring degree {self.ring_degree} x all-to-all degree {self.group.size()} (two zigzag chunks per "
               "ring rank)")
        return f"sequence length {length}{where} is not divisible by {cut}"

    def shard(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's shard of ``t`` along ``dim`` (the full sequence, the same on every rank)."""
        problem = self.length_problem(t.shape[dim], f" (dim {dim})")
        if problem:
            raise UnsupportedAttention(f"{problem}; pad it to a multiple of {self.multiple}")
        if self.ring_group is not None:
            t = zigzag_shard(t, self.ring_group.rank(), self.ring_degree, dim)
        share = t.shape[dim] // self.group.size()
        # the backend follows this dimension through the graph to refuse ops that mix tokens
        return mark_sequence_dim(t.narrow(dim, self.group.rank() * share, share), dim, self.group)

    def gather(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The full sequence from every rank's shard (all-gathers along ``dim``)."""
        if self.group.size() > 1:
            t = all_gather(t, self.group, dim)
        if self.ring_group is None:
            return t
        return zigzag_unshard(list(all_gather(t, self.ring_group, dim).chunk(self.ring_degree, dim=dim)), dim)

    def positions(self, local_length: int, device=None) -> torch.Tensor:
        """Position ids ``[1, local_length]`` of this rank's shard within the full sequence."""
        if self.ring_group is None:
            start = self.group.rank() * local_length
            return mark_sequence_dim(torch.arange(start, start + local_length, device=device).unsqueeze(0), 1,
                                     self.group)
        return self.shard(torch.arange(local_length * self.ranks, device=device).unsqueeze(0), dim=1)


def shard_sequence(t: torch.Tensor, cp_mesh=None, dim: int = 1) -> torch.Tensor:
    """This rank's shard of ``t`` along ``dim`` (the full sequence is the same on every
    rank). Refuses lengths the layout cannot cut evenly."""
    return Layout.of(cp_mesh).shard(t, dim)


def gather_sequence(t: torch.Tensor, cp_mesh=None, dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's shard (all-gathers along ``dim``)."""
    return Layout.of(cp_mesh).gather(t, dim)


def global_positions(local_length: int, cp_mesh=None, device=None) -> torch.Tensor:
    """Position ids ``[1, local_length]`` of this rank's shard within the full sequence
    (feed them to RoPE so that a shard is rotated as in the unsharded model)."""
    return Layout.of(cp_mesh).positions(local_length, device)
