"""A small Llama-style decoder (RMSNorm, RoPE, GQA attention through SDPA, SwiGLU) for the
demo and the benchmarks. Plain PyTorch: nothing in it knows about context parallelism;
the upipe backend finds its SDPA calls in the compiled graph."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaConfig:
    vocab: int = 512
    hidden: int = 256
    layers: int = 2
    q_heads: int = 8
    kv_heads: int = 2
    ffn: int = 512
    rope_theta: float = 500000.0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.q_heads


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding of ``x`` [B, H, S, D] at absolute ``positions`` [B, S]."""
    dim = x.shape[-1]
    freqs = theta ** (-torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim)
    angles = positions.to(torch.float32)[:, None, :, None] * freqs
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.wq = nn.Linear(cfg.hidden, cfg.q_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.q_heads * cfg.head_dim, cfg.hidden, bias=False)

    def forward(self, x, positions):
        b, s, _ = x.shape
        c = self.cfg
        q = self.wq(x).view(b, s, c.q_heads, c.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, c.kv_heads, c.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, c.kv_heads, c.head_dim).transpose(1, 2)
        q, k = rope(q, positions, c.rope_theta), rope(k, positions, c.rope_theta)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.hidden)
        self.attn = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.hidden)
        self.w1 = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.w3 = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.w2 = nn.Linear(cfg.ffn, cfg.hidden, bias=False)

    def forward(self, x, positions):
        x = x + self.attn(self.attn_norm(x), positions)
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class TinyLlama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, tokens, positions):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, positions)
        return self.head(self.norm(x))


def build(cfg: LlamaConfig, seed: int = 0) -> TinyLlama:
    torch.manual_seed(seed)
    return TinyLlama(cfg)
