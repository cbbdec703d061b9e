"""Rank-side jobs for tests/test_ring.py (module-level so spawn can pickle them)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests_support import AttentionCase, make_inputs
from upipe_compile.attention.ring import ring_backward, ring_forward, zigzag_shard


def ring_case(case: AttentionCase):
    """Ring attention of this rank's zigzag share over the whole world as the ring:
    (out, lse, dq, dk, dv) shares."""
    rank, ring = dist.get_rank(), dist.get_world_size()
    q, k, v, dout = (zigzag_shard(x, rank, ring, dim=2) for x in make_inputs(case))
    out, lse = ring_forward(q, k, v, case.is_causal, case.scale, dist.group.WORLD)
    dq, dk, dv = ring_backward(dout, q, k, v, out, lse, case.is_causal, case.scale, dist.group.WORLD)
    return out, lse, dq, dk, dv


def odd_share_case():
    q = torch.zeros(1, 2, 3, 8)
    return ring_forward(q, q, q, True, None, dist.group.WORLD)
