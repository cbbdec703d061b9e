"""DeepSpeed's Ulysses (``deepspeed.sequence.layer.DistributedAttention``) as a peer for the
throughput benchmark: the same SDPA, the same tiny-Llama block, only the context-parallel
attention swapped.

DeepSpeed's layout is ``[B, S, H, D]`` (batch first; ``batch_dim_idx=0``): on the way in,
``scatter_idx=2`` splits the heads and ``gather_idx=1`` gathers the sequence, so each rank
attends over the full sequence with ``H/P`` heads; the output all-to-all swaps them back.
GQA: DistributedAttention shards the KV heads by the key's head count, so q head ``h`` and
its KV head ``h // g`` land on the same rank when ``Hkv`` is a multiple of P (DeepSpeed
refuses ``Hkv < P``).

Everything here is optional: :func:`unavailable_reason` says why DeepSpeed cannot be used
in this environment (not installed, import error, init error), and the benchmark prints
that reason instead of a number.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.tiny_llama import Attention, Block, LlamaConfig, rope

_reason: str | None = None
_initialised = False


def unavailable_reason() -> str | None:
    """None when ``import deepspeed`` and its DistributedAttention work here, else why not
    (one line). Cheap after the first call."""
    global _reason
    if _reason is None and not _initialised:
        try:
            import deepspeed  # noqa: F401
            from deepspeed.sequence.layer import DistributedAttention  # noqa: F401
        except Exception as error:  # ImportError, or whatever its import-time probing raises
            _reason = f"deepspeed unavailable: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    return _reason


def init(backend: str) -> str | None:
    """Attach deepspeed.comm to the already-initialised torch.distributed group (call on every
    rank after ``init_process_group``). Returns the reason DeepSpeed cannot run, or None."""
    global _reason, _initialised
    if unavailable_reason() is not None:
        return _reason
    if _initialised:
        return None
    try:
        import importlib

        import deepspeed

        # (``deepspeed.comm.torch`` as an attribute is the torch package, re-exported by a
        # star import; the module itself is only reachable by its full name.)
        ds_torch_comm = importlib.import_module("deepspeed.comm.torch")

        # DeepSpeed's torch backend JIT-builds a shared-memory all-reduce op on CPU at init
        # (ninja + a C++ compiler, ~20 s the first time). DistributedAttention never uses it:
        # its all-to-all goes straight to torch.distributed.all_to_all_single. Skip the build.
        ds_torch_comm.build_shm_op = lambda: None
        for name in ("DeepSpeed", "deepspeed"):
            logging.getLogger(name).setLevel(logging.ERROR)
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        for key, value in {"RANK": rank, "WORLD_SIZE": world, "LOCAL_RANK": rank, "LOCAL_WORLD_SIZE": world}.items():
            os.environ.setdefault(key, str(value))
        deepspeed.init_distributed(dist_backend=backend, verbose=False)
        _initialised = True
    except Exception as error:
        _reason = f"deepspeed.init_distributed(dist_backend={backend!r}) failed: {type(error).__name__}: {error}"
    return _reason


def version() -> str:
    import deepspeed

    return deepspeed.__version__


def _local_sdpa(q, k, v):
    """What DistributedAttention calls between its all-to-alls: ``[B, S, H/P, D]`` in and out."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    )
    return out.transpose(1, 2)


def distributed_attention(group) -> nn.Module:
    """``DistributedAttention`` over ``group`` for ``[B, S/P, H, D]`` q, k, v (call as
    ``attn(q, k, v, 0)``, 0 = batch dim)."""
    from deepspeed.sequence.layer import DistributedAttention

    return DistributedAttention(_local_sdpa, group, scatter_idx=2, gather_idx=1)


class DeepSpeedAttention(Attention):
    """tiny_llama's Attention with its SDPA replaced by DeepSpeed's Ulysses; same parameters
    (so a state dict loads either way), same RoPE at global positions, before the all-to-all."""

    def __init__(self, cfg: LlamaConfig, group):
        super().__init__(cfg)
        self.dist_attn = distributed_attention(group)

    def forward(self, x, positions):
        b, s, _ = x.shape
        c = self.cfg
        q = self.wq(x).view(b, s, c.q_heads, c.head_dim)
        k = self.wk(x).view(b, s, c.kv_heads, c.head_dim)
        v = self.wv(x).view(b, s, c.kv_heads, c.head_dim)
        # rope works on [B, H, S, D]; DeepSpeed takes [B, S, H, D] (its pre-all-to-all copy
        # makes the layout contiguous either way).
        q = rope(q.transpose(1, 2), positions, c.rope_theta).transpose(1, 2)
        k = rope(k.transpose(1, 2), positions, c.rope_theta).transpose(1, 2)
        out = self.dist_attn(q, k, v, 0)
        return self.wo(out.reshape(b, s, -1))


def deepspeed_block(cfg: LlamaConfig, group, state_dict=None) -> Block:
    """A tiny_llama Block whose attention is DeepSpeed's Ulysses over ``group``."""
    block = Block(cfg)
    block.attn = DeepSpeedAttention(cfg, group)
    if state_dict is not None:
        block.load_state_dict(state_dict)
    return block
