"""benchmarks/gpu_check.py's sections on what the attention kernels compute (1, 5, 8) and
whether their varlen path blocks on the host (7); benchmarks/gpu_check.py's docstring says
what each checks. Each section returns ([(title, rows)], ok)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks import kernel_check
from upipe_compile.attention import kernels
from upipe_compile.attention.document_boundaries import Documents

TOLERANCE = kernel_check.TOLERANCE


def rel(actual, expected) -> float:  # kernel_check's measure, so every section's errors compare
    return kernel_check.relative_error(actual, expected)


# --- 1 ---------------------------------------------------------------------------------------
def section_kernels(device, quick):
    rows = []
    for name, kernel_device, pair in kernel_check.available_kernels():
        if kernel_device.type != device.type:
            continue
        for shape in kernel_check.SHAPES[:1] if quick else kernel_check.SHAPES:
            for is_causal in (True, False):
                rows.append({"kernel": name, **kernel_check.check(pair, kernel_device, shape, is_causal)})
    return [("1. kernels vs SDPA math (fp32), bf16", rows)], all(r["ok"] for r in rows) and bool(rows)


# --- 5 ---------------------------------------------------------------------------------------
def section_packed(device, quick):
    batch, q_heads, kv_heads, dim = 2, 8, 2, 128
    seq = 256 if quick else 2048
    bound_sets = [
        [0, seq],
        [0, 1, 2, seq // 2, seq],
        [0, 100, 101, 700 % seq or 7, seq - 1, seq],
        [0, seq // 4, seq // 2, 3 * seq // 4, seq],
        [0] + sorted(torch.randperm(seq - 1, generator=torch.Generator().manual_seed(1))[:13].add(1).tolist()) + [seq],
    ]
    rows = []
    gen = torch.Generator().manual_seed(0)
    # every usable kernel of this device (FA3/FA4: varlen; cuDNN: per document; flash-attn, aten)
    pairs = [(name, pair) for name, pair_device, pair in kernel_check.available_kernels()
             if pair_device.type == device.type]
    for bounds in bound_sets:
        bounds = sorted(set(bounds))
        documents = Documents.from_bounds(bounds, device)
        for is_causal in (True, False):
            q, dout = (torch.randn(batch, q_heads, seq, dim, generator=gen).to(device, torch.bfloat16) for _ in range(2))
            k, v = (torch.randn(batch, kv_heads, seq, dim, generator=gen).to(device, torch.bfloat16) for _ in range(2))
            ref = [t.float().requires_grad_(True) for t in (q, k, v)]
            expected_out, expected_lse = torch.empty_like(ref[0]), torch.empty(batch, q_heads, seq, device=device)
            for start, end in documents.spans:
                piece = slice(start, end)
                qd, kd, vd = (t[:, :, piece] for t in ref)
                with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
                    o = F.scaled_dot_product_attention(qd, kd, vd, is_causal=is_causal, enable_gqa=True)
                o.backward(dout[:, :, piece].float())
                expected_out[:, :, piece] = o.detach()
                scores = qd.detach() @ kd.detach().repeat_interleave(q_heads // kv_heads, 1).transpose(-1, -2) * dim**-0.5
                if is_causal:
                    n = end - start
                    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool, device=device).triu(1), float("-inf"))
                expected_lse[:, :, piece] = scores.logsumexp(-1)
            for name, pair in pairs:
                if documents.is_single:
                    out, lse = pair.forward(q, k, v, is_causal, None)
                    dq, dk, dv = pair.backward(dout, q, k, v, out, lse, is_causal, None)
                else:
                    out, lse = pair.forward_documents(q, k, v, documents, is_causal, None)
                    dq, dk, dv = pair.backward_documents(dout, q, k, v, out, lse, documents, is_causal, None)
                errors = {"out": rel(out, expected_out), "lse": rel(lse, expected_lse), "dq": rel(dq, ref[0].grad),
                          "dk": rel(dk, ref[1].grad), "dv": rel(dv, ref[2].grad)}
                shown = bounds if len(bounds) <= 8 else bounds[:4] + ["..."] + bounds[-2:]
                rows.append({"kernel": name, "cu_seqlens": str(shown), "documents": len(bounds) - 1,
                             "shortest": min(e - s for s, e in documents.spans), "causal": is_causal,
                             **errors, "ok": max(errors.values()) < TOLERANCE})
    title = (f"5. packed sequences: each usable kernel ({', '.join(name for name, _ in pairs)}) "
             f"with document boundaries vs SDPA math per document, B={batch} {q_heads}q/{kv_heads}kv D{dim} S{seq} bf16")
    return [(title, rows)], all(r["ok"] for r in rows) and bool(rows)


# --- 7 ---------------------------------------------------------------------------------------
def section_varlen_syncs(device, quick):
    """After one warm-up call (which may read the boundaries back and cache them), the varlen
    forward + backward and a document_sdpa layer run under set_sync_debug_mode("error"): a
    blocking host<->device copy (torch.tensor of a list, .tolist(), .item()) raises."""
    if device.type != "cuda":
        return [("7. varlen backward host syncs: skipped (needs CUDA)", [])], True
    from upipe_compile.packed.document_sdpa import document_sdpa

    batch, q_heads, kv_heads, dim = 2, 8, 2, 128
    seq = 4096 if quick else 65536
    gen = torch.Generator().manual_seed(0)
    bounds = [0, *sorted(torch.randperm(seq - 1, generator=gen)[: seq // 64].add(1).tolist()), seq]
    documents = Documents.from_bounds(bounds, device)
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=device)
    q, dout = (torch.randn(batch, q_heads, seq, dim, generator=gen).to(device, torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(batch, kv_heads, seq, dim, generator=gen).to(device, torch.bfloat16) for _ in range(2))

    def kernel_step():
        out, lse = kernels.forward(q, k, v, True, None, documents)
        return kernels.backward(dout, q, k, v, out, lse, True, None, documents)

    def sdpa_layer():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        document_sdpa(*leaves, cu_seqlens, is_causal=True, enable_gqa=True).backward(dout)

    rows = []
    for name, step in (("kernels.forward + backward", kernel_step), ("document_sdpa forward + backward", sdpa_layer)):
        step()
        torch.cuda.synchronize()
        previous, error = torch.cuda.get_sync_debug_mode(), ""
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
        except RuntimeError as e:
            error = str(e).splitlines()[0][:120]
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        torch.cuda.synchronize()
        rows.append({"call": name, "documents": len(bounds) - 1, "blocking sync": error or "none", "ok": not error})
    title = (f"7. varlen backward host syncs: {kernels.kernels_for(q).name}, B={batch} {q_heads}q/{kv_heads}kv "
             f"D{dim} S{seq} bf16, second call under set_sync_debug_mode('error')")
    return [(title, rows)], all(r["ok"] for r in rows)


# --- 8 ---------------------------------------------------------------------------------------
def section_fused_block_bf16(device, quick):
    """The fused attention block in bf16 on a one-rank group (NCCL on CUDA, gloo elsewhere)
    against the same block written plainly in float32 from the same bf16 inputs, beside the
    plain block in bf16 (what an unfused model computes): the fused block's error must stay
    within 1.5x of the plain bf16 block's, for y, dx and every weight gradient."""
    import torch.distributed as dist

    from upipe_compile.block.ops import upipe_attention_block
    from upipe_compile.block.region import BlockRegion

    if dist.is_initialized():
        raise RuntimeError("section 8 needs a process without a default process group")
    q_heads, kv_heads, dim = (8, 2, 64) if quick else (32, 8, 128)
    seq, model = (256, q_heads * dim) if quick else (8192, q_heads * dim)
    heads = lambda p, n: p.unflatten(-1, (n, dim)).transpose(1, 2)  # noqa: E731
    region = BlockRegion(q_heads, kv_heads, dim, heads, heads, heads, True, None)
    gen = torch.Generator().manual_seed(0)
    x, dy = (torch.randn(1, seq, model, generator=gen).to(device, torch.bfloat16) for _ in range(2))
    shapes = {"wq": q_heads * dim, "wk": kv_heads * dim, "wv": kv_heads * dim, "wo": model}
    weights = {name: (torch.randn(rows, model, generator=gen) / model**0.5).to(device, torch.bfloat16)
               for name, rows in shapes.items()}

    def plain(x, wq, wk, wv, wo):
        b, s, _ = x.shape
        q, k, v = heads(x @ wq.T, q_heads), heads(x @ wk.T, kv_heads), heads(x @ wv.T, kv_heads)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return o.transpose(1, 2).reshape(b, s, -1) @ wo.T

    def grads(fn, dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (x, *weights.values())]
        y = fn(*leaves)
        y.backward(dy.to(dtype))
        return [y.detach().float()] + [t.grad.float() for t in leaves]

    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        fused = grads(lambda x, wq, wk, wv, wo: upipe_attention_block(
            x, wq, None, wk, None, wv, None, wo, None, [], region, heads_per_stage=1), torch.bfloat16)
    finally:
        dist.destroy_process_group()
    stock, exact = grads(plain, torch.bfloat16), grads(plain, torch.float32)
    rows = []
    for name, f, s_, e in zip(["y", "dx", "dwq", "dwk", "dwv", "dwo"], fused, stock, exact):
        ratio = rel(f, e) / max(rel(s_, e), 1e-12)
        rows.append({"tensor": name, "fused err": rel(f, e), "plain bf16 err": rel(s_, e), "ratio": ratio,
                     "ok": ratio < 1.5})
    title = (f"8. fused block bf16 vs the plain block: {q_heads}q/{kv_heads}kv D{dim} S{seq}, {q_heads} stages "
             "(U = 1 head a stage), errors against float32 from the same bf16 inputs")
    return [(title, rows)], all(r["ok"] for r in rows)

