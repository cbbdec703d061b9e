"""The zigzag layout of a ring of R ranks: the sequence cut into 2R equal chunks, ring rank
``r`` holding chunks ``r`` and ``2R - 1 - r`` (concatenated), so that every rank has the same
amount of causal work. Pure layout arithmetic, below everything that uses it (ring attention,
sharding, the documents read from positions)."""

from __future__ import annotations

from typing import Optional

import torch


def zigzag_chunks(rank: int, ring: int) -> tuple[int, int]:
    """The two sequence chunks (of 2R) ring rank ``rank`` holds, in its order."""
    return rank, 2 * ring - 1 - rank


def zigzag_shard(full: torch.Tensor, rank: int, ring: int, dim: int) -> torch.Tensor:
    """Ring rank ``rank``'s share of ``full`` along ``dim`` (its two chunks, concatenated)."""
    if full.shape[dim] % (2 * ring):
        raise ValueError(f"a sequence of {full.shape[dim]} tokens cannot be cut into 2 x {ring} equal chunks for "
                         f"a ring of {ring} ranks: pad it to a multiple of {2 * ring}")
    chunks = full.chunk(2 * ring, dim=dim)
    return torch.cat([chunks[c] for c in zigzag_chunks(rank, ring)], dim=dim)


def zigzag_unshard(shares: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The full-sequence tensor from every ring rank's share, in rank order."""
    ring = len(shares)
    chunks: list[Optional[torch.Tensor]] = [None] * (2 * ring)
    for rank, share in enumerate(shares):
        first, second = share.chunk(2, dim=dim)
        a, b = zigzag_chunks(rank, ring)
        chunks[a], chunks[b] = first, second
    return torch.cat(chunks, dim=dim)
