"""What the fused attention-block op knows about one block besides its tensors.

Whoever describes a block (a caller of :func:`upipe_compile.upipe_attention_block`, or a
compiler pass that proves a graph region head-separable) hands the fused op
(:mod:`upipe_compile.block.loop`) a :class:`BlockRegion`; the two meet only here.

A region is, per role r in (q, k, v):

    projected_r = F.linear(input_r, W_r[rows of the heads], b_r[rows] or None)  # [..., n * R_r]
    r_heads     = region.head_fn(r)(projected_r, n, *extras)                   # [B, n, s, D]

where ``n`` is how many heads are being computed (any n: the head count in the block's
view/reshape arguments was replaced by ``n``), ``input_r`` is the block input ``x`` or, where
:attr:`BlockRegion.projection_inputs` says so, one of the extras (MLA's k and v project the
normalised KV latent), head ``h``'s rows of ``W_r`` are ``[h * R_r, (h + 1) * R_r)`` with
``R_r = rows(W_r) / heads of r`` (``D`` unless the head fn splits a head's rows: MLA's
``kv_b_proj`` rows hold a head's k part and its v part), and ``extras`` are the block's other
tensor inputs the per-head ops read (RoPE cos/sin or freqs_cis, QK-norm weights), the same
list for all three roles. Then

    out_heads [B, n, s, D] (attention of those heads)
    y += F.linear(out_heads[..., :Dv].transpose(1, 2).reshape(B, s, n * Dv), W_o[:, cols of the heads])
    y += b_o (once)

where ``Dv`` is :attr:`BlockRegion.value_dim` (``D`` unless v's head fn zero-pads a narrower
value head to ``D``, as MLA's does).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:
    import torch

HeadFn = Callable[..., "torch.Tensor"]  # (projected [B, s, n*D], n: int, *extras) -> [B, n, s, D]


@dataclass(frozen=True)
class BlockRegion:
    q_heads: int
    kv_heads: int
    head_dim: int
    q_fn: HeadFn
    k_fn: HeadFn
    v_fn: HeadFn
    is_causal: bool
    scale: Optional[float]
    source_line: str = ""
    """The block's SDPA call in the user's source, for messages."""
    window: tuple[int, int] = (-1, -1)
    """Sliding window as flash-attn counts it (global positions; -1 = unbounded)."""
    softcap: float = 0.0
    """Attention-logit softcap (0 = off)."""
    sinks_extra: int = -1
    """Which of ``extras`` holds the per-query-head sink logits ``[Hq]`` (-1: no sinks); the
    head fns do not read it, the stage loops slice it with each stage's heads."""
    value_dim: int = 0
    """Columns of each head's output the output projection reads (0: all ``head_dim``)."""
    projection_inputs: tuple[int, int, int] = (-1, -1, -1)
    """What q, k and v project: -1 the block input ``x``, i ``extras[i]`` (q's is always x)."""
    attention_dtype: Optional["torch.dtype"] = None
    """The dtype the head fns hand attention where it is not x's (torchtitan 0.3's varlen
    attention casts q, k, v to bf16): the kept output and the output gradient are in it."""
    alibi_extra: int = -1
    """Which of ``extras`` holds the per-query-head ALiBi slopes ``[Hq]`` (-1: no ALiBi); as
    with sinks, the head fns do not read it and the stage loops slice it with each stage's
    heads. The slopes take no gradient."""

    def head_fn(self, role: str) -> HeadFn:
        return {"q": self.q_fn, "k": self.k_fn, "v": self.v_fn}[role]

    def heads(self, role: str) -> int:
        return self.q_heads if role == "q" else self.kv_heads

    @property
    def output_dim(self) -> int:
        """Each head's output columns the output projection reads."""
        return self.value_dim or self.head_dim

    def projection_input(self, role: str, x, extras: list):
        index = self.projection_inputs["qkv".index(role)]
        return x if index < 0 else extras[index]


# The op takes an int, not the region (custom ops take tensors and scalars only). The
# registry holds regions weakly, so it keeps no extracted head fns alive across recompiles:
# a region the fusion pass registers is held by the graph module it rewrote (``owner``),
# which Dynamo keeps while the compiled graph can run; any other by whoever registered it.
_REGIONS: weakref.WeakValueDictionary[int, BlockRegion] = weakref.WeakValueDictionary()
_IDS: weakref.WeakKeyDictionary[BlockRegion, int] = weakref.WeakKeyDictionary()
_OWNED: weakref.WeakKeyDictionary[object, list[BlockRegion]] = weakref.WeakKeyDictionary()
_NEXT_ID = itertools.count()
_LOCK = threading.Lock()


def register_region(region: BlockRegion, owner: Optional[object] = None) -> int:
    """The region's id (the same id for an equal region while one is registered). It stays
    registered while ``owner`` (the graph module whose op calls carry the id) or the caller
    holds it."""
    with _LOCK:
        region_id = _IDS.get(region)
        registered = None if region_id is None else _REGIONS.get(region_id)
        if registered is None:
            registered, region_id = region, next(_NEXT_ID)
            _IDS[region] = region_id
            _REGIONS[region_id] = region
        if owner is not None:
            _OWNED.setdefault(owner, []).append(registered)
        return region_id


def region_by_id(region_id: int) -> BlockRegion:
    region = _REGIONS.get(region_id)
    if region is None:
        raise RuntimeError(
            f"fused attention block {region_id} is not registered in this process: a graph that calls "
            "upipe::attention_block must be compiled in the process that runs it, and runs only while the "
            "graph module the pass rewrote is alive (torch._dynamo.reset() releases it)"
        )
    return region
