"""torchtitan 0.3's Llama3 debug model with its varlen attention (``varlen_attn`` over the
documents of one packed row, fused ``wqkv``, complex RoPE at the documents' positions), for
the 0.3 tier (scripts/test_torchtitan03.sh). Module-level for spawned ranks."""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist

import upipe_compile
from tests_support import attention_events

LAYERS = 2
LENGTHS = (7, 1, 30, 26)  # 64 tokens: a document of one token, documents crossing the shards of 2 and 4 ranks
VOCAB = 2048


def build(attn_backend: str = "varlen", window=None, kv_heads=None):
    """The debug model (two layers; ``kv_heads``: GQA, its fused wqkv laid out per KV group as
    Llama3-8B's), seeded: identical on every process."""
    from torchtitan.models.llama3 import _build_llama3_layers, compute_ffn_hidden_dim, model_registry

    config = model_registry("debugmodel", attn_backend=attn_backend).model
    layers = config.layers[:LAYERS]
    if kv_heads is not None:
        attention = layers[0].attention
        layers = _build_llama3_layers(fuse_qkv=True, n_layers=LAYERS, dim=config.dim, n_heads=attention.n_heads,
                                      n_kv_heads=kv_heads, hidden_dim=compute_ffn_hidden_dim(config.dim, multiple_of=256),
                                      rope=attention.rope, attn_backend=attn_backend)
    if window is not None:  # every layer's varlen attention with a sliding window
        for layer in layers:
            layer.attention.inner_attention.window_size = window
    config = dataclasses.replace(config, layers=layers)
    torch.manual_seed(0)
    model = config.build()
    model.init_states(buffer_device=None)
    return model.float().train()


def inputs():
    gen = torch.Generator().manual_seed(1)
    seq = sum(LENGTHS)
    tokens = torch.randint(0, VOCAB, (1, seq), generator=gen)
    positions = torch.cat([torch.arange(n) for n in LENGTHS]).unsqueeze(0)
    dout = torch.randn(1, seq, VOCAB, generator=gen)
    return tokens, positions, dout


def _grads(model):
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def varlen_on_cpu(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                  enable_gqa=False, return_aux=None, num_splits=None, **unused):
    """varlen_attn's meaning on one CPU process (its flash kernel is CUDA-only): attention
    within each document of ``cu_seq_q``, through upipe's single-process document attention."""
    assert cu_seq_k is cu_seq_q and return_aux is None and not unused
    left, right = window_size
    causal = right == 0
    out = upipe_compile.document_sdpa(q.unsqueeze(0).transpose(1, 2), k.unsqueeze(0).transpose(1, 2),
                                      v.unsqueeze(0).transpose(1, 2), cu_seq_q, is_causal=causal, scale=scale,
                                      window=None if left < 0 and (causal or right < 0) else
                                      ((left, left) if causal else (left, right)),
                                      enable_gqa=enable_gqa)
    return out.transpose(1, 2).squeeze(0)


class _TorchWithExactAttention:
    """torch as 0.3's attention module sees it, but for its bf16 cast: float32 instead."""

    bfloat16 = torch.float32

    def __getattr__(self, name):
        return getattr(torch, name)


def reference(window=None, kv_heads=None, exact: bool = False):
    """CP = 1: the whole row through the eager model (varlen_attn on the CPU as above):
    (logits, param grads). ``exact``: without the attention's cast to bf16 (the model is fp32
    throughout: what both bf16 runs are measured against)."""
    from unittest import mock

    from torchtitan.models.common.attention import create_varlen_metadata_for_document

    model = build(window=window, kv_heads=kv_heads)
    tokens, positions, dout = inputs()
    with contextlib.ExitStack() as patches:
        patches.enter_context(mock.patch("torchtitan.models.common.attention.varlen_attn", varlen_on_cpu))
        if exact:
            patches.enter_context(mock.patch("torchtitan.models.common.attention.torch", _TorchWithExactAttention()))
        logits = model(tokens, positions, create_varlen_metadata_for_document(positions))
    (logits * dout).sum().backward()
    return logits.detach(), _grads(model)


def compiled_case(fuse: bool, window=None, kv_heads=None, ring: int = 1):
    """This rank's shard at CP = P through the model compiled with backend="upipe": the row's
    documents (VarlenMetadata of the whole row), this rank's tokens and positions: (logits
    shard, param grads, upipe op counts). ``ring`` > 1: over a (ring, all-to-all) mesh, in
    its zigzag layout; the logits come back gathered and cut as contiguous shards."""
    from torchtitan.models.common.attention import create_varlen_metadata_for_document

    from upipe_compile.sharding import gather_sequence, shard_sequence

    torch._dynamo.reset()
    world, rank = dist.get_world_size(), dist.get_rank()
    assert world > 1
    mesh, options = None, {"inner_backend": "aot_eager", "fuse_projections": fuse}
    if ring > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (ring, world // ring), mesh_dim_names=("cp_ring", "cp_a2a"))
        options["cp_mesh"] = mesh
    model = build(window=window, kv_heads=kv_heads)
    tokens, positions, dout = inputs()
    masks = create_varlen_metadata_for_document(positions)
    tokens, local_positions, dout = (shard_sequence(t, mesh, dim=1) for t in (tokens, positions, dout))
    compiled = torch.compile(model, backend="upipe", options=options)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        logits = compiled(tokens, local_positions, masks)
        (logits * dout).sum().backward()
    logits = logits.detach()
    if mesh is not None:
        logits = gather_sequence(logits, mesh, dim=1).chunk(world, dim=1)[rank]
    return logits, _grads(model), dict(attention_events(prof))


def flex_refusal():
    """0.3's default (Flex) attention at CP = 2: the refusal's text."""
    torch._dynamo.reset()
    model = build("flex")
    tokens, positions, _ = inputs()
    tokens, local_positions = (upipe_compile.shard_sequence(t, dim=1) for t in (tokens, positions))
    masks = model.get_attention_masks(local_positions)  # a mask over the shard: attention on it alone
    try:  # without gradients: torch's FlexAttention has no CPU backward to trace
        with torch.no_grad():
            torch.compile(model, backend="upipe", options={"inner_backend": "aot_eager"})(tokens, local_positions, masks)
    except Exception as e:  # noqa: BLE001 (the test reads the message)
        return f"{type(e).__name__}: {e}"
    return None
