"""ALiBi's shared test pieces: slopes, attention written out with the ALiBi bias on the full
sequence, a model layer that calls ``document_sdpa(..., alibi_slopes=...)``, and the jobs that
run on every rank of a RankPool (module-level so spawn can pickle them)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests_support import AttentionCase, TinyVariantAttention, make_inputs, make_sinks, variant_math


def make_slopes(case: AttentionCase, kind: str = "geometric") -> torch.Tensor:
    """float32 ``[Hq]``: Bloom's geometric slopes ``2^(-8 h / Hq)`` (h = 1..Hq) shuffled by the
    seed, or uniform ones in [0, 1.5) (``kind="random"``); every head's differs, so a slope
    that reaches the wrong head shows."""
    gen = torch.Generator().manual_seed(case.seed + 4)
    heads = case.q_heads
    if kind == "random":
        return torch.rand(heads, generator=gen) * 1.5
    slopes = 2.0 ** (-8.0 * torch.arange(1, heads + 1, dtype=torch.float64) / heads)
    return slopes[torch.randperm(heads, generator=gen)].float()


def alibi_math(q, k, v, *, is_causal, scale, slopes, window=None, softcap=None, sinks=None, bounds=None):
    """Attention written out on the whole sequence (differentiable): scores, softcap, then
    ALiBi's ``-slope[h] * |i - j|`` for global positions ``i``, ``j``, the causal / window /
    document mask, softmax (with sinks), values (:func:`tests_support.variant_math`)."""
    return variant_math(q, k, v, is_causal=is_causal, scale=scale, window=window, softcap=softcap, sinks=sinks,
                        slopes=slopes, bounds=bounds)


def alibi_reference(case: AttentionCase, slopes, window=None, softcap=None, sinks=None, bounds=None):
    """``(out, dq, dk, dv, dsinks)`` of :func:`alibi_math` in float64 on the full sequence
    (dsinks None without sinks)."""
    q, k, v, dout = (t.double().requires_grad_(True) for t in make_inputs(case))
    sink_param = None if sinks is None else sinks.double().requires_grad_(True)
    out = alibi_math(q, k, v, is_causal=case.is_causal, scale=case.scale, slopes=slopes.double(), window=window,
                     softcap=softcap, sinks=sink_param, bounds=bounds)
    out.backward(dout.detach())
    return out.detach(), q.grad, k.grad, v.grad, None if sinks is None else sink_param.grad


class TinyAlibiAttention(TinyVariantAttention):
    """TinyVariantAttention with ALiBi: its slopes a buffer (not trained), passed to
    ``document_sdpa`` as a model does; ``reference=True`` writes it out (float64)."""

    def __init__(self, case: AttentionCase, slopes, window=None, softcap=None, with_sinks=False, reference=False):
        super().__init__(case, window, softcap, with_sinks, reference)
        self.register_buffer("alibi", slopes.clone())

    def attend(self, q, k, v):
        from upipe_compile import document_sdpa

        c = self.case
        if self.reference:
            return alibi_math(q.double(), k.double(), v.double(), is_causal=c.is_causal, scale=c.scale,
                              slopes=self.alibi.double(), window=self.window, softcap=self.softcap,
                              sinks=self.sinks).to(q.dtype)
        return document_sdpa(q, k, v, is_causal=c.is_causal, scale=c.scale, enable_gqa=True, window=self.window,
                             softcap=self.softcap, sinks=self.sinks, alibi_slopes=self.alibi)


def _local(case: AttentionCase):
    """This rank's contiguous shard of q, k, v (leaves needing grad) and of the upstream gradient."""
    rank, world = dist.get_rank(), dist.get_world_size()
    q, k, v, dout = (x.chunk(world, dim=2)[rank].clone() for x in make_inputs(case))
    for x in (q, k, v):
        x.requires_grad_(True)
    return q, k, v, dout


def _recording_backend(options):
    """The upipe passes with ``options`` then the inner backend, recording the upipe ops the
    rewritten graphs hold into the returned list."""
    from upipe_compile.backend import apply_upipe_passes, inner_backend

    seen = []

    def backend(gm, example_inputs):
        gm = apply_upipe_passes(gm, options)
        seen.extend(str(n.target) for m in gm.modules() if isinstance(m, torch.fx.GraphModule)
                    for n in m.graph.nodes if str(n.target).startswith("upipe."))
        return inner_backend(options.inner_backend)(gm, example_inputs)

    return backend, seen


def compiled_document_sdpa_case(case: AttentionCase, slopes, window, softcap, with_sinks: bool, bounds=None,
                                inner_backend: str = "eager"):
    """``document_sdpa(..., alibi_slopes=slopes)`` compiled with the upipe backend on this rank's
    shard: ``(out, dq, dk, dv, dsinks, the upipe ops the graph holds)`` (dsinks: this rank's
    heads' share, None without sinks)."""
    from upipe_compile import document_sdpa
    from upipe_compile.options import UPipeOptions

    torch._dynamo.reset()
    q, k, v, dout = _local(case)
    sinks = make_sinks(case).requires_grad_(True) if with_sinks else None
    cu_seqlens = None if bounds is None else torch.tensor(bounds, dtype=torch.int32)
    backend, seen = _recording_backend(UPipeOptions(heads_per_stage=case.heads_per_stage, prefetch=case.prefetch,
                                                    inner_backend=inner_backend))

    def attend(q, k, v, slopes, sinks, cu_seqlens):
        return document_sdpa(q, k, v, cu_seqlens, is_causal=case.is_causal, scale=case.scale, enable_gqa=True,
                             window=window, softcap=softcap, sinks=sinks, alibi_slopes=slopes)

    out = torch.compile(attend, backend=backend, dynamic=False)(q, k, v, slopes, sinks, cu_seqlens)
    out.backward(dout)
    torch._dynamo.reset()
    return out.detach(), q.grad, k.grad, v.grad, None if sinks is None else sinks.grad, sorted(set(seen))


def alibi_op_case(case: AttentionCase, slopes, window=None, softcap=None, with_sinks: bool = False, bounds=None):
    """``upipe_attention(..., alibi_slopes=slopes)`` (the eager entry point) on this rank's shard:
    ``(out, dq, dk, dv, dsinks)``."""
    import upipe_compile

    q, k, v, dout = _local(case)
    sinks = make_sinks(case).requires_grad_(True) if with_sinks else None
    out = upipe_compile.upipe_attention(
        q, k, v, is_causal=case.is_causal, scale=case.scale, enable_gqa=True, heads_per_stage=case.heads_per_stage,
        prefetch=case.prefetch, cu_seqlens=None if bounds is None else torch.tensor(bounds, dtype=torch.int32),
        window=window, softcap=softcap, sinks=sinks, alibi_slopes=slopes,
    )
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad, None if sinks is None else sinks.grad


def _through_flash_standin(family: str, job, *args):
    """``job(*args)`` with the CPU kernel replaced by FlashAttnKernels over a CPU stand-in of
    that flash-attn release (what the CUDA path runs), and the calls that reached it."""
    from flash_attn_standins import FAMILIES

    from upipe_compile.attention import kernels

    cpu, interface = kernels._CPU, FAMILIES[family]()
    kernels._CPU = kernels.FlashAttnKernels(interface)
    try:
        result = job(*args)
    finally:
        kernels._CPU = cpu
    return result, list(interface.calls)


def _flash_calls_summary(calls) -> list[tuple]:
    """Per call with ALiBi slopes: ``(causal, left, right)`` as flash received them."""
    summary = []
    for call in calls:
        if call.get("alibi_slopes") is None:
            continue
        left, right = call["window_size"] if "window_size" in call else (call["window_size_left"],
                                                                          call["window_size_right"])
        summary.append((bool(call["causal"]), int(left), int(right)))
    return summary


def alibi_op_case_with_flash_standin(case: AttentionCase, family: str, slopes, window=None, softcap=None,
                                     bounds=None):
    """alibi_op_case through the flash-attn adapter: ``(out, dq, dk, dv, calls with ALiBi)``."""
    result, calls = _through_flash_standin(family, alibi_op_case, case, slopes, window, softcap, False, bounds)
    return (*result[:4], _flash_calls_summary(calls))


def alibi_ring_case(case: AttentionCase, slopes, window=(-1, -1), softcap: float = 0.0, bounds=None,
                    family: str | None = None):
    """Ring attention with ALiBi over the whole world as the ring, on this rank's zigzag share:
    ``(out, lse, dq, dk, dv)`` (through a flash-attn stand-in with ``family``)."""
    from upipe_compile.attention.ring import ring_backward, ring_forward
    from upipe_compile.attention.zigzag import zigzag_shard
    from upipe_compile.attention.document_boundaries import Documents

    def run():
        rank, ring = dist.get_rank(), dist.get_world_size()
        documents = None if bounds is None else Documents.from_bounds(bounds, torch.device("cpu"))
        q, k, v, dout = (zigzag_shard(x, rank, ring, dim=2) for x in make_inputs(case))
        group = dist.group.WORLD
        out, lse = ring_forward(q, k, v, case.is_causal, case.scale, group, softcap, window, documents, slopes)
        grads = ring_backward(dout, q, k, v, out, lse, case.is_causal, case.scale, group, softcap, window, documents,
                              slopes)
        return (out, lse, *grads)

    return run() if family is None else _through_flash_standin(family, run)[0]


def compiled_alibi_block_case(case: AttentionCase, slopes, window, softcap, with_sinks: bool, fuse: bool,
                              recompute: bool = False, ring: int | None = None):
    """TinyAlibiAttention compiled with backend="upipe" (aot_eager) on this rank's shard, fused
    or not, over a (ring, all-to-all) mesh with ``ring``: ``(out, dx, param grads, the upipe
    ops the graph holds)``."""
    import upipe_compile
    from tests_support import block_grads, make_block_inputs
    from upipe_compile.options import UPipeOptions

    torch._dynamo.reset()
    mesh = None
    if ring is None:
        rank, world = dist.get_rank(), dist.get_world_size()
        x, dout = (t.chunk(world, dim=1)[rank] for t in make_block_inputs(case))
    else:
        from ring_jobs import _ring_mesh

        mesh = _ring_mesh(ring)
        x, dout = (upipe_compile.shard_sequence(t, mesh, dim=1) for t in make_block_inputs(case))
    options = UPipeOptions(cp_mesh=mesh, heads_per_stage=case.heads_per_stage, prefetch=case.prefetch,
                           fuse_projections=fuse, inner_backend="aot_eager", recompute_attention_output=recompute)
    backend, seen = _recording_backend(options)
    model = torch.compile(TinyAlibiAttention(case, slopes, window, softcap, with_sinks), backend=backend)
    out, dx, grads = block_grads(model, x, dout)
    torch._dynamo.reset()
    return out, dx, grads, sorted(set(seen))


def alibi_block_reference(case: AttentionCase, slopes, window, softcap, with_sinks: bool):
    from tests_support import block_grads, make_block_inputs

    x, dout = make_block_inputs(case)
    return block_grads(TinyAlibiAttention(case, slopes, window, softcap, with_sinks, reference=True), x, dout)
