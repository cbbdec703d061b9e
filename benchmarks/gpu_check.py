"""The first command on a GPU node: does the CUDA path work, and does the memory model hold?

    python benchmarks/gpu_check.py                 # one GPU, about 3 minutes on an H100
    python benchmarks/gpu_check.py --quick         # small shapes; also runs on CPU (a smoke test)

Eight sections, each a table; a section that fails prints its traceback and the others still
run; the exit status is non-zero when any check failed.

1. kernels: benchmarks/kernel_check.py's checks on this device's kernels (aten flash;
   flash-attn if installed) against SDPA's float32 math.
2. stage-loop memory: one rank's forward + backward of the stage loops
   (``stage_loop_forward`` / ``stage_loop_backward``) on real device tensors over a *fake*
   process group of P ranks (Llama3-8B heads: 32 q, 8 kv, head_dim 128, bf16, causal). The
   collectives move nothing (their outputs are uninitialised) but every allocation is real,
   so ``torch.cuda.max_memory_allocated`` is the real peak. Measured: the peak beyond the op's
   inputs and outputs (fwd: q, k, v, out, lse; bwd: also dout, dq, dk, dv), against
   ``upipe_compile.measure.memory.measure_op_memory(..., cuda_kernel=<this kernel>)`` on fake
   tensors, which is what benchmarks/op_memory.py reports. U = P (UPipe) and U = Hq (Ulysses).
3. stage-loop time: the same calls timed (no communication: the stage loop's kernels and
   copies alone), UPipe over Ulysses.
4. offload: 8 checkpointed MLP blocks (d 4096, bf16) with and without
   ``upipe_compile.stack.offload.BlockInputOffloader``: gradients equal, peak memory saved vs the
   block inputs' size, step time. Weight gradients go to the host as they are made (as a
   sharded gradient would leave), so the peak is the activations'.
5. packed sequences: the kernels' varlen path (``Documents`` boundaries, single-token
   documents included) against SDPA run per document: out, lse, dq, dk, dv.
6. offload host buffers: two steps of 2 offloaded blocks whose input is not a power of two
   in bytes: each block's host buffer holds exactly the input's bytes, is pinned (CUDA), is
   the same memory in step 2, and torch's pinned allocator (which rounds up to a power of
   two) grew by nothing.
7. varlen host syncs (CUDA): a second packed forward + backward (and a ``document_sdpa``
   layer) under ``torch.cuda.set_sync_debug_mode("error")``: no blocking host<->device copy.
8. fused block bf16: the fused attention block (one head a stage) on a one-rank group against
   the plain block, both bf16, errors against float32: within 1.5x of the plain block's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tabulate import tabulate  # noqa: E402

from benchmarks import kernel_check  # noqa: E402
from upipe_compile.attention import kernels  # noqa: E402
from upipe_compile.packed.documents import Documents  # noqa: E402
from upipe_compile.measure.memory import fake_process_group, measure_op_memory  # noqa: E402

from upipe_compile.options import StageLoopSettings  # noqa: E402
from upipe_compile.attention.stage_loop import stage_loop_backward, stage_loop_forward  # noqa: E402

GiB = 2**30
TOLERANCE = kernel_check.TOLERANCE
LLAMA3_8B = dict(q_heads=32, kv_heads=8, head_dim=128)


def device_line(device: torch.device) -> str:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return (f"{props.name}, {props.total_memory / GiB:.1f} GiB, {props.multi_processor_count} SMs, "
                f"torch {torch.__version__}, CUDA {torch.version.cuda}")
    return f"CPU, torch {torch.__version__}"


def cuda_kernel_name() -> str:
    return "flash-attn" if kernels._flash_attn_interface() is not None else "aten-flash"


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Peak:
    """Peak bytes allocated beyond what was allocated on entry (None off CUDA)."""

    def __init__(self, device):
        self.device, self.extra = device, None

    def __enter__(self):
        sync(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        sync(self.device)
        self.seconds = time.perf_counter() - self.start
        if self.device.type == "cuda":
            self.extra = torch.cuda.max_memory_allocated(self.device) - self.base


def rel(actual, expected) -> float:
    return kernel_check.relative_error(actual, expected)


# --- 1 -------------------------------------------------------------------------------------
def section_kernels(device, quick):
    rows = []
    for name, kernel_device, pair in kernel_check.available_kernels():
        if kernel_device.type != device.type:
            continue
        for shape in kernel_check.SHAPES[:1] if quick else kernel_check.SHAPES:
            for is_causal in (True, False):
                rows.append({"kernel": name, **kernel_check.check(pair, kernel_device, shape, is_causal)})
    return [("1. kernels vs SDPA math (fp32), bf16", rows)], all(r["ok"] for r in rows) and bool(rows)


# --- 2 and 3 ---------------------------------------------------------------------------------
def section_stage_loop(device, quick, world, seqs, reps):
    q_heads, kv_heads, dim = LLAMA3_8B["q_heads"], LLAMA3_8B["kv_heads"], LLAMA3_8B["head_dim"]
    kernel = cuda_kernel_name() if device.type == "cuda" else None
    memory_rows, time_rows, ok = [], [], True
    with fake_process_group(world) as group:
        for seq in seqs:
            s_local = seq // world
            gen = torch.Generator(device=device).manual_seed(0)
            q = torch.randn(1, q_heads, s_local, dim, device=device, dtype=torch.bfloat16, generator=gen)
            k = torch.randn(1, kv_heads, s_local, dim, device=device, dtype=torch.bfloat16, generator=gen)
            v, dout = torch.randn_like(k), torch.randn_like(q)
            times = {}
            for u in sorted({world, q_heads}):
                settings = StageLoopSettings(True, None, u, world, group.group_name, "forward")
                fwd_times, bwd_times = [], []
                for _ in range(reps):
                    with Peak(device) as fwd:
                        out, lse = stage_loop_forward(q, k, v, settings)
                    with Peak(device) as bwd:
                        dq, dk, dv, _ = stage_loop_backward(dout, q, k, v, out, lse, settings)
                    fwd_times.append(fwd.seconds)
                    bwd_times.append(bwd.seconds)
                    measured_fwd = None if fwd.extra is None else fwd.extra - nbytes(out, lse)
                    measured_bwd = None if bwd.extra is None else bwd.extra - nbytes(dq, dk, dv)
                    del out, lse, dq, dk, dv
                model = measure_op_memory(group, seq=seq, q_heads=q_heads, kv_heads=kv_heads, head_dim=dim,
                                          heads_per_stage=u, dtype=torch.bfloat16, cuda_kernel=kernel)
                method = "Ulysses" if u == q_heads else "UPipe"
                for phase, modelled, measured in (("fwd", model.forward_bytes, measured_fwd),
                                                  ("bwd", model.backward_bytes, measured_bwd)):
                    ratio = None if measured is None else measured / modelled
                    row_ok = ratio is None or 0.9 <= ratio <= 1.1
                    ok &= row_ok
                    memory_rows.append({
                        "seq": seq, "S_local": s_local, "method": method, "U": u, "phase": phase,
                        "modelled_GiB": modelled / GiB,
                        "measured_GiB": None if measured is None else measured / GiB,
                        "measured/modelled": ratio, "ok (±10%)": row_ok,
                    })
                best = min(f + b for f, b in zip(fwd_times, bwd_times))
                times[u] = best
                time_rows.append({
                    "seq": seq, "S_local": s_local, "method": method, "U": u,
                    "fwd_ms": 1e3 * min(fwd_times), "bwd_ms": 1e3 * min(bwd_times), "fwd+bwd_ms": 1e3 * best,
                })
            for row in time_rows[-len(times):]:
                row["vs Ulysses"] = times[row["U"]] / times[q_heads]
            del q, k, v, dout
    title = (f"2. stage-loop peak beyond inputs/outputs, one rank of P={world} (fake group, real "
             f"{device.type} tensors), Llama3-8B 32q/8kv D128 bf16 causal; model: measure_op_memory"
             f"(cuda_kernel={kernel!r})")
    time_title = (f"3. stage-loop time, one rank of P={world}, no communication (fake group), "
                  f"best of {reps}")
    return [(title, memory_rows), (time_title, time_rows)], ok


# --- 4 ---------------------------------------------------------------------------------------
class MLPBlock(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.up, self.down = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(3 * dim, dim, bias=False)

    def forward(self, x):
        return x + self.down(F.silu(self.up(self.norm(x))))


def section_offload(device, quick, n_blocks, dim, tokens, reps):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from upipe_compile.stack.offload import BlockInputOffloader

    torch.manual_seed(0)
    dtype = torch.bfloat16
    blocks = [checkpoint_wrapper(MLPBlock(dim).to(device, dtype)) for _ in range(n_blocks)]
    x = torch.randn(1, tokens, dim, device=device, dtype=dtype)
    params = [p for b in blocks for p in b.parameters()]
    host_grads = {p: torch.empty(p.shape, dtype=p.dtype, pin_memory=device.type == "cuda") for p in params}

    def to_host(param):
        # As FSDP's reduce-scatter would: each weight gradient leaves the device once made.
        # Kept on the device, they grow by 3/4 of a block input per block as the inputs
        # are freed, and the peak would measure them rather than the offload. (Same stream:
        # the device memory is reused only after the copy.)
        host_grads[param].copy_(param.grad, non_blocking=True)
        param.grad = None

    hooks = [p.register_post_accumulate_grad_hook(to_host) for p in params]

    def step():
        h = x.clone().requires_grad_()
        inp = h
        for block in blocks:
            h = block(h)
        h.float().square().mean().backward()
        return inp.grad

    results = {}
    for offload in (False, True):
        offloader = BlockInputOffloader(blocks) if offload else None
        try:
            step()  # warm up (pinned host blocks, kernels)
            peaks, seconds = [], []
            for _ in range(reps):
                with Peak(device) as measured:
                    input_grad = step()
                # after Peak's exit, which waits for the weight gradients' copies to the host
                grads = input_grad, [host_grads[p].clone() for p in params]
                peaks.append(measured.extra)
                seconds.append(measured.seconds)
            results[offload] = (grads, peaks[-1], min(seconds),
                                offloader.offloaded_bytes_last_step if offloader else 0)
            del grads
        finally:
            if offloader:
                offloader.remove()
    for hook in hooks:
        hook.remove()
    (ref_x, ref_p), peak_plain, t_plain, _ = results[False]
    (got_x, got_p), peak_off, t_off, offloaded = results[True]
    error = max([rel(got_x, ref_x)] + [rel(a, b) for a, b in zip(got_p, ref_p)])
    exact = torch.equal(got_x, ref_x) and all(torch.equal(a, b) for a, b in zip(got_p, ref_p))
    input_bytes = tokens * dim * 2
    saved = None if peak_plain is None else peak_plain - peak_off
    saved_ok = saved is None or saved >= 0.5 * (n_blocks - 1) * input_bytes
    row = {
        "blocks": n_blocks, "dim": dim, "tokens": tokens, "block_input_MiB": input_bytes / 2**20,
        "offloaded_MiB": offloaded / 2**20,
        "peak_GiB plain": None if peak_plain is None else peak_plain / GiB,
        "peak_GiB offload": None if peak_off is None else peak_off / GiB,
        "saved_MiB": None if saved is None else saved / 2**20,
        "saved / block inputs": None if saved is None else saved / input_bytes,
        "step_ms plain": 1e3 * t_plain, "step_ms offload": 1e3 * t_off, "time ratio": t_off / t_plain,
        "grads bit-equal": exact, "max rel err": error,
        "ok": (exact or error <= 1e-6) and saved_ok and offloaded == n_blocks * input_bytes,
    }
    title = ("4. offload of checkpointed block inputs (eager checkpoint_wrapper, bf16, weight gradients "
             "moved to host as made); ok: grads equal (<=1e-6 rel), all block inputs offloaded, peak saved "
             ">= half of (blocks-1) block inputs")
    return [(title, [row])], row["ok"]


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
    for bounds in bound_sets:
        bounds = sorted(set(bounds))
        documents = Documents.from_bounds(bounds, device)
        for is_causal in (True, False):
            q, dout = (torch.randn(batch, q_heads, seq, dim, generator=gen).to(device, torch.bfloat16) for _ in range(2))
            k, v = (torch.randn(batch, kv_heads, seq, dim, generator=gen).to(device, torch.bfloat16) for _ in range(2))
            out, lse = kernels.forward(q, k, v, is_causal, None, documents)
            dq, dk, dv = kernels.backward(dout, q, k, v, out, lse, is_causal, None, documents)
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
            errors = {"out": rel(out, expected_out), "lse": rel(lse, expected_lse), "dq": rel(dq, ref[0].grad),
                      "dk": rel(dk, ref[1].grad), "dv": rel(dv, ref[2].grad)}
            shown = bounds if len(bounds) <= 8 else bounds[:4] + ["..."] + bounds[-2:]
            rows.append({"cu_seqlens": str(shown), "documents": len(bounds) - 1,
                         "shortest": min(e - s for s, e in documents.spans), "causal": is_causal,
                         **errors, "ok": max(errors.values()) < TOLERANCE})
    title = (f"5. packed sequences: {kernels.kernels_for(torch.empty(0, device=device, dtype=torch.bfloat16)).name} "
             f"with document boundaries vs SDPA math per document, B={batch} {q_heads}q/{kv_heads}kv D{dim} S{seq} bf16")
    return [(title, rows)], all(r["ok"] for r in rows)


# --- 6 ---------------------------------------------------------------------------------------
def section_offload_host_buffers(device, quick):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from upipe_compile.stack.offload import BlockInputOffloader

    dim, tokens = (128, 320) if quick else (4096, 20480)  # 80 KiB / 160 MiB: 5 x a power of two
    blocks = [checkpoint_wrapper(MLPBlock(dim).to(device, torch.bfloat16)) for _ in range(2)]
    input_bytes = tokens * dim * 2

    def pinned_allocator_bytes():  # what torch's caching host allocator holds (None off CUDA)
        if device.type != "cuda" or not hasattr(torch.cuda, "host_memory_stats"):
            return None
        stats = torch.cuda.host_memory_stats()
        return stats.get("allocated_bytes.current", stats.get("allocated_bytes.all.current", 0))

    before = pinned_allocator_bytes()
    offloader = BlockInputOffloader(blocks)
    pointers = []
    try:
        for _ in range(2):
            h = torch.randn(1, tokens, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
            for block in blocks:
                h = block(h)
            h.float().square().mean().backward()
            sync(device)
            pointers.append([offloader.host_buffer(i).data_ptr() for i in range(len(blocks))])
        buffers = [offloader.host_buffer(i) for i in range(len(blocks))]
        after = pinned_allocator_bytes()
        row = {
            "block_input_bytes": input_bytes,
            "buffer_bytes": str(sorted({b.untyped_storage().nbytes() for b in buffers})),
            "pinned": all(b.is_pinned() for b in buffers) if device.type == "cuda" else None,
            "same buffers step 2": pointers[1] == pointers[0],
            "pinned allocator growth": None if before is None else after - before,
            "power-of-two rounding would take": 1 << (input_bytes - 1).bit_length(),
        }
    finally:
        offloader.remove()
    row["ok"] = (all(b.untyped_storage().nbytes() == input_bytes for b in buffers) and row["same buffers step 2"]
                 and row["pinned"] is not False and not row["pinned allocator growth"])
    title = ("6. offload host buffers (2 blocks, bf16, 2 steps); ok: buffer = exactly the block input's bytes, "
             "pinned on CUDA, reused in step 2, torch's rounding pinned allocator not used")
    return [(title, [row])], row["ok"]


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small shapes (a smoke test; runs on CPU too)")
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--seqs", default=None, help="comma-separated full sequence lengths for sections 2-3 "
                        "(default 262144,524288,1048576; --quick: 1024)")
    parser.add_argument("--only", default=None, help="comma-separated section numbers to run (default all)")
    parser.add_argument("--out", help="also write the tables to this markdown file")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    seqs = [int(s) for s in args.seqs.split(",")] if args.seqs else ([1024] if args.quick else [2**18, 2**19, 2**20])
    only = None if args.only is None else {int(s) for s in args.only.split(",")}
    sections = [
        (1, lambda: section_kernels(device, args.quick)),
        (2, lambda: section_stage_loop(device, args.quick, args.world, seqs, reps=2)),
        (4, lambda: section_offload(device, args.quick, 8 if not args.quick else 3, 4096 if not args.quick else 128,
                                    32768 if not args.quick else 256, reps=3)),
        (5, lambda: section_packed(device, args.quick)),
        (6, lambda: section_offload_host_buffers(device, args.quick)),
        (7, lambda: section_varlen_syncs(device, args.quick)),
        (8, lambda: section_fused_block_bf16(device, args.quick)),
    ]
    lines = [f"# device: {device_line(device)}", f"# command: python benchmarks/gpu_check.py {' '.join(argv or sys.argv[1:])}".rstrip()]
    print("\n".join(lines), flush=True)
    failed = []
    for number, run in sections:
        if only is not None and number not in only:
            continue
        start = time.perf_counter()
        try:
            tables, ok = run()
        except Exception:  # each section reports its own failure and the rest still run
            text = f"\n## section {number}: FAILED with an exception\n```\n{traceback.format_exc()}```"
            tables, ok = [], False
            print(text, flush=True)
            lines.append(text)
        for title, rows in tables:
            text = f"\n## {title}\n\n" + tabulate(rows, headers="keys", floatfmt=".3g", tablefmt="github")
            print(text, flush=True)
            lines.append(text)
        status = f"\nsection {number}: {'ok' if ok else 'FAILED'} ({time.perf_counter() - start:.1f} s)"
        print(status, flush=True)
        lines.append(status)
        if not ok:
            failed.append(number)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    summary = f"\n{'all sections passed' if not failed else f'FAILED sections: {failed}'}"
    print(summary)
    lines.append(summary)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
