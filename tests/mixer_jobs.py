"""Rank jobs for the mixer stage loop (module-level so spawned ranks can pickle them): each
mixer kind's tensors, the loop on this rank's shard, and the mixer on the whole sequence."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from upipe_compile.mixers.lightning import lightning_attention
from upipe_compile.mixers.loop import loop_backward, loop_forward, run_mixer
from upipe_compile.mixers.registry import KINDS


@dataclass(frozen=True)
class MixerCase:
    kind: str
    world: int
    heads: int
    groups: int  # Mamba2's B/C groups, the gated delta rule's q/k heads (heads share them)
    stages: int
    seq_local: int
    seed: int


def _implementation(kind: str):
    if kind == "mamba2_chunk_scan":
        from transformers.models.bamba.modeling_bamba import mamba2_chunk_scan

        return getattr(mamba2_chunk_scan, "__wrapped_original__", mamba2_chunk_scan)
    if kind == "selective_scan":
        from transformers.models.jamba.modeling_jamba import mamba_selective_scan

        return getattr(mamba_selective_scan, "__wrapped_original__", mamba_selective_scan)
    if kind == "gated_delta_rule":
        from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

        return getattr(torch_chunk_gated_delta_rule, "__wrapped_original__", torch_chunk_gated_delta_rule)
    return lightning_attention


def make_tensors(case: MixerCase) -> tuple[list, dict]:
    """The mixer's tensors over the whole sequence and its settings."""
    gen = torch.Generator().manual_seed(case.seed)
    seq, h = case.seq_local * case.world, case.heads

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).double()

    if case.kind == "mamba2_chunk_scan":
        tensors = [rand(1, seq, h, 4), rand(1, seq, h, scale=0.5), -rand(h).abs() - 0.1,
                   rand(1, seq, case.groups, 3), rand(1, seq, case.groups, 3), rand(h), rand(h, scale=0.5)]
        return tensors, {"chunk_size": 3, "dt_softplus": True, "dt_limit": "0.0,inf"}
    if case.kind == "gated_delta_rule":  # q, k: one head per group of value heads
        tensors = [rand(1, seq, case.groups, 4, scale=0.5), rand(1, seq, case.groups, 4, scale=0.5), rand(1, seq, h, 4),
                   -rand(1, seq, h, scale=0.3).abs(), torch.sigmoid(rand(1, seq, h))]
        return tensors, {"chunk_size": 4, "use_qk_l2norm_in_kernel": True}
    if case.kind == "selective_scan":
        tensors = [rand(1, h, seq), rand(1, h, seq, scale=0.5), -rand(h, 3).abs() - 0.1, rand(1, 3, seq),
                   rand(1, 3, seq), rand(h), rand(1, h, seq), rand(h, scale=0.5)]
        return tensors, {"delta_softplus": True}
    tensors = [rand(1, h, seq, 4, scale=0.5), rand(1, h, seq, 4, scale=0.5), rand(1, h, seq, 4),
               torch.rand(h, 1, 1, generator=gen).double() + 0.05]
    return tensors, {"block_size": 3}


def _shard(case, layout, t):
    if layout.seq is None:
        return t
    return t.chunk(case.world, dim=layout.seq)[dist.get_rank()].contiguous()


def reference(case: MixerCase):
    """The mixer on the whole sequence: (output, gradients of every tensor) for a fixed dout."""
    spec = KINDS[case.kind]
    tensors, settings = make_tensors(case)
    leaves = [t.requires_grad_() for t in tensors]
    out = run_mixer(spec, _implementation(case.kind), leaves, settings, None)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(case.seed + 1)).double()
    out.backward(dout)
    return out.detach(), [t.grad for t in leaves], dout


def loop_case(case: MixerCase):
    """This rank's output shard and its gradients (parameters: this rank's share)."""
    spec = KINDS[case.kind]
    tensors, settings = make_tensors(case)
    _, _, dout = reference(case)
    local = [_shard(case, layout, t) for layout, t in zip(spec.inputs, tensors)]
    group = dist.group.WORLD.group_name
    out = loop_forward(spec, _implementation(case.kind), local, settings, group, case.world, case.stages)
    grads = loop_backward(spec, _implementation(case.kind), local, settings, group, case.world, case.stages,
                          _shard(case, spec.output, dout))
    return out, grads
