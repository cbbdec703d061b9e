"""Rank jobs of the installed-package checks (check_installed.py): what a user writes, run on
2 gloo ranks against eager on the full, unsharded sequence. Module-level so spawned ranks can
unpickle them; it imports only the installed package and its path's libraries."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

import upipe_compile  # noqa: E402

SEQ, VOCAB, HIDDEN, HEADS, KV_HEADS = 64, 97, 64, 8, 4


class TinyAttentionModel(torch.nn.Module):
    """Embedding, one GQA attention block with RoPE from the positions it is given, an LM head:
    the shape of model the README's Use snippet calls as ``model(tokens, positions)``."""

    def __init__(self):
        super().__init__()
        self.head_dim = HIDDEN // HEADS
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.q = torch.nn.Linear(HIDDEN, HEADS * self.head_dim, bias=False)
        self.kv = torch.nn.Linear(HIDDEN, 2 * KV_HEADS * self.head_dim, bias=False)
        self.o = torch.nn.Linear(HEADS * self.head_dim, HIDDEN, bias=False)
        self.head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)

    def rope(self, x, positions):
        half = self.head_dim // 2
        freqs = positions[..., None].float() / 10000 ** (torch.arange(half) / half)
        cos, sin = freqs.cos()[:, None], freqs.sin()[:, None]
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)

    def forward(self, tokens, positions):
        x = self.embed(tokens)
        b, s, _ = x.shape
        q = self.q(x).view(b, s, HEADS, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, KV_HEADS, self.head_dim).unbind(2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        q, k = self.rope(q, positions), self.rope(k, positions)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(out.transpose(1, 2).reshape(b, s, -1))
        return self.head(x)


def _inputs():
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    dout = torch.randn(2, SEQ, VOCAB, generator=gen)
    return tokens, dout


def _grads(model):
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def use_snippet():
    """The README's Use snippet, as written there (the default options but the mesh and U),
    beside eager on the full sequence: every rank returns (its logits, eager's shard of
    them, its parameter gradients, eager's), to be compared by the caller."""
    torch.manual_seed(0)
    model = TinyAttentionModel()
    tokens, dout = _inputs()
    reference = model(tokens, torch.arange(SEQ).expand(2, SEQ))
    (reference * dout).sum().backward()
    reference_grads = _grads(model)
    model.zero_grad(set_to_none=True)

    P = dist.get_world_size()
    mesh = init_device_mesh("cpu", (P,), mesh_dim_names=("cp",))
    compiled = torch.compile(model, backend="upipe", options={"cp_mesh": mesh, "heads_per_stage": P})
    local_tokens = upipe_compile.shard_sequence(tokens, mesh, dim=1)
    positions = upipe_compile.global_positions(local_tokens.shape[1], mesh)
    logits = compiled(local_tokens, positions)
    (logits * upipe_compile.shard_sequence(dout, mesh, dim=1)).sum().backward()
    grads = _grads(model)
    for g in grads.values():
        dist.all_reduce(g)  # each rank's gradient covers its shard's tokens: their sum is the whole's
    return (logits.detach(), upipe_compile.shard_sequence(reference.detach(), mesh, dim=1), grads,
            reference_grads)


def llama_through_register():
    """A transformers Llama loaded with register()'s attention, at its config's defaults
    (use_cache on), compiled with backend="upipe": (local logits, eager's shard, grads summed
    over ranks, eager's grads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from upipe_compile.integrations.transformers import register

    def build(attn_implementation):
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=HEADS,
                             num_key_value_heads=KV_HEADS, intermediate_size=128, max_position_embeddings=4 * SEQ,
                             attn_implementation=attn_implementation)
        torch.manual_seed(0)
        return LlamaForCausalLM(config).float()

    tokens, dout = _inputs()
    eager = build("eager")
    reference = eager(input_ids=tokens).logits
    (reference * dout).sum().backward()

    model = build(register())
    compiled = torch.compile(model, backend="upipe")
    local_tokens = upipe_compile.shard_sequence(tokens, dim=1)
    positions = upipe_compile.global_positions(local_tokens.shape[1])
    logits = compiled(input_ids=local_tokens, position_ids=positions).logits
    (logits * upipe_compile.shard_sequence(dout, dim=1)).sum().backward()
    grads = _grads(model)
    for g in grads.values():
        dist.all_reduce(g)
    return logits.detach(), upipe_compile.shard_sequence(reference.detach(), dim=1), grads, _grads(eager)
