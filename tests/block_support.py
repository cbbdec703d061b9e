"""Hand-written attention blocks for the fused op's tests: the region's head fns (plain,
RoPE, Qwen3-style QK-norm + RoPE), their tensors, and the eager full-sequence reference."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tests_support import DTYPES, AttentionCase
from upipe_compile.block.region import BlockRegion


@dataclass(frozen=True)
class BlockCase(AttentionCase):
    kind: str = "plain"
    """The per-head ops: plain, rope, qwen3 (QK-norm over head_dim, then RoPE), or mla
    (DeepSeek-V3's: k and v from one projection of a KV latent, a head-shared key part, v
    narrower than q/k and zero-padded)."""
    biases: bool = False
    recompute_output: bool = False
    """The op keeps no attention output and runs each stage's attention forward again in backward."""

    @property
    def model_dim(self) -> int:
        return 3 * self.head_dim


def _heads(p, n, dim):
    return p.view(p.shape[0], p.shape[1], n, dim)


def _rotate_half(t):
    half = t.shape[-1] // 2
    return torch.cat((-t[..., half:], t[..., :half]), dim=-1)


def _rope(t, cos, sin):  # t [B, n, s, D]; cos/sin [B, s, D]
    return t * cos.unsqueeze(1) + _rotate_half(t) * sin.unsqueeze(1)


def _norm(t, weight):
    return F.rms_norm(t, (t.shape[-1],), weight, eps=1e-6)


def mla_dims(case: BlockCase) -> tuple[int, int, int, int]:
    """(nope, rope, value, latent) dims of the mla kind: q/k's head dim is nope + rope."""
    nope = case.head_dim // 2
    return nope, case.head_dim - nope, case.head_dim // 2, 2 * case.head_dim


def _mla_region(case: BlockCase) -> BlockRegion:
    dim = case.head_dim
    nope, _, value, _ = mla_dims(case)

    def q_fn(p, n, latent, k_rot):
        return _heads(p, n, dim).transpose(1, 2)

    def kv_heads(p, n):  # kv_b_proj's rows: each head's k part, then its v part
        return p.view(p.shape[0], p.shape[1], n, nope + value).transpose(1, 2)

    def k_fn(p, n, latent, k_rot):
        return torch.cat((kv_heads(p, n)[..., :nope], k_rot.expand(-1, n, -1, -1)), dim=-1)

    def v_fn(p, n, latent, k_rot):
        return F.pad(kv_heads(p, n)[..., nope:], (0, dim - value))

    return BlockRegion(case.q_heads, case.kv_heads, dim, q_fn, k_fn, v_fn, case.is_causal, case.scale,
                       value_dim=value, projection_inputs=(-1, 0, 0))


def make_region(case: BlockCase) -> BlockRegion:
    dim = case.head_dim
    if case.kind == "mla":
        return _mla_region(case)

    def plain(p, n, *extras):
        return _heads(p, n, dim).transpose(1, 2)

    def rope(p, n, cos, sin, *rest):
        return _rope(_heads(p, n, dim).transpose(1, 2), cos, sin)

    def q_qwen3(p, n, cos, sin, q_norm, k_norm):
        return _rope(_norm(_heads(p, n, dim), q_norm).transpose(1, 2), cos, sin)

    def k_qwen3(p, n, cos, sin, q_norm, k_norm):
        return _rope(_norm(_heads(p, n, dim), k_norm).transpose(1, 2), cos, sin)

    q_fn, k_fn = {"plain": (plain, plain), "rope": (rope, rope), "qwen3": (q_qwen3, k_qwen3)}[case.kind]
    return BlockRegion(case.q_heads, case.kv_heads, dim, q_fn, k_fn, plain, case.is_causal, case.scale)


def make_tensors(case: BlockCase):
    """Full-sequence x, upstream gradient, weights (wq, bq, wk, bk, wv, bv, wo, bo) and
    full-sequence extras, identical in every process."""
    gen = torch.Generator().manual_seed(case.seed)
    dtype = DTYPES[case.dtype]
    d, dim = case.model_dim, case.head_dim

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    x = randn(case.batch, case.seq, d)
    dy = randn(case.batch, case.seq, d)
    bias = (lambda n: randn(n, scale=0.1)) if case.biases else (lambda n: None)
    kv_rows, kv_in, out_cols = dim, d, dim
    if case.kind == "mla":
        nope, rope, out_cols, kv_in = mla_dims(case)
        kv_rows = nope + out_cols
    weights = [randn(case.q_heads * dim, d, scale=d ** -0.5), bias(case.q_heads * dim),
               randn(case.kv_heads * kv_rows, kv_in, scale=kv_in ** -0.5), bias(case.kv_heads * kv_rows),
               randn(case.kv_heads * kv_rows, kv_in, scale=kv_in ** -0.5), bias(case.kv_heads * kv_rows),
               randn(d, case.q_heads * out_cols, scale=(case.q_heads * out_cols) ** -0.5), bias(d)]
    extras = []
    if case.kind == "mla":  # the KV latent [B, S, L] and the head-shared rotary key part [B, 1, S, r]
        extras += [randn(case.batch, case.seq, kv_in), randn(case.batch, 1, case.seq, rope)]
    if case.kind in ("rope", "qwen3"):
        positions = torch.arange(case.seq, dtype=torch.float32)
        freqs = positions[:, None] / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        angles = torch.cat((freqs, freqs), dim=-1).expand(case.batch, -1, -1)
        extras += [angles.cos().to(dtype), angles.sin().to(dtype)]
    if case.kind == "qwen3":
        extras += [1 + randn(dim, scale=0.1), 1 + randn(dim, scale=0.1)]
    return x, dy, weights, extras


def sequence_dim(case: BlockCase, extra: torch.Tensor):
    """The dim an extra runs along the sequence in (sharded with x), or None (norm weights)."""
    if case.kind == "mla":
        return extra.dim() - 2
    return 1 if extra.dim() == 3 and extra.shape[1] == case.seq else None


def needs_grad(case: BlockCase, extra: torch.Tensor) -> bool:
    """Every extra but the positions' cos/sin (the MLA latents come from x in a model)."""
    return case.kind == "mla" or sequence_dim(case, extra) is None


def eager_block(x, weights, extras, region: BlockRegion):
    wq, bq, wk, bk, wv, bv, wo, bo = weights
    q = region.q_fn(F.linear(x, wq, bq), region.q_heads, *extras)
    k = region.k_fn(F.linear(region.projection_input("k", x, extras), wk, bk), region.kv_heads, *extras)
    v = region.v_fn(F.linear(region.projection_input("v", x, extras), wv, bv), region.kv_heads, *extras)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=region.is_causal, scale=region.scale, enable_gqa=True)
    o = o[..., :region.output_dim]
    batch, _, seq, dim = o.shape
    return F.linear(o.transpose(1, 2).reshape(batch, seq, -1), wo, bo)


def eager_block_reference(case: BlockCase, in_case_dtype: bool = False):
    """(y, dx, [weight grads], [extra grads]) on the full sequence, in float64 (the case's
    bf16 or fp32 tensors upcast) unless ``in_case_dtype`` (then: what an eager model in the
    case's dtype computes, whose error against float64 is what that dtype can promise)."""
    x, dy, weights, extras = make_tensors(case)
    upcast = (lambda t: t) if in_case_dtype else (lambda t: None if t is None else t.double())
    x, dy = upcast(x).requires_grad_(), upcast(dy)
    weights = [None if w is None else upcast(w).requires_grad_() for w in weights]
    extras = [upcast(e).requires_grad_(needs_grad(case, e)) for e in extras]
    y = eager_block(x, weights, extras, make_region(case))
    y.backward(dy)
    return y.detach(), x.grad, [None if w is None else w.grad for w in weights], \
        [e.grad for e in extras if e.requires_grad]
