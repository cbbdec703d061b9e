"""benchmarks/gpu_check.py's sections on memory: the stage loops' peak against the memory
model and their time (2, 3), and block-input offload (4, 6); benchmarks/gpu_check.py's
docstring says what each checks. Each section returns ([(title, rows)], ok)."""

from __future__ import annotations

import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from benchmarks.gpu_check_kernels import rel
from upipe_compile.attention import kernels
from upipe_compile.measure.memory import fake_process_group, measure_op_memory

from upipe_compile.attention.stage_loop import StageLoopSettings  # noqa: E402
from upipe_compile.attention.stage_loop import stage_loop_backward, stage_loop_forward

GiB = 2**30
LLAMA3_8B = dict(q_heads=32, kv_heads=8, head_dim=128)


def cuda_kernel_name() -> str:
    return kernels.cuda_kernel().name


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

