"""Throughput of context-parallel attention on real ranks: forward + backward time of
(a) the attention op alone and (b) a small Llama-style decoder block, for

  * Ulysses (ours)          upipe_compile with U = all query heads (the baseline)
  * UPipe U=P, UPipe U=2P   upipe_compile's stage loop (default prefetch: the next stage's
                            all-to-alls start during this stage's forward kernel)
  * UPipe U=P, no prefetch / prefetch both
                            the same loop with prefetch off / also in backward (A/B)
  * DeepSpeed Ulysses       deepspeed.sequence.layer.DistributedAttention
  * torch ring CP           torch.distributed.tensor.experimental.context_parallel

over P ranks (gloo on CPU, NCCL when there is a GPU per rank), plus the compile time of
backend="upipe" against the plain inner backend on the same block.

    python benchmarks/throughput.py                       # P in {2, 4}, a few lengths, minutes on 2 cores
    python benchmarks/throughput.py --world 4 --seqs 4096 8192 --repeats 7
    python benchmarks/throughput.py --quick --out-dir /tmp/x   # tiny model, aot_eager: a smoke run

All methods run in one process group per P, interleaved step by step (so a noisy machine
slows all of them alike): warm-up, then the median of the repeats, each step timed as the
slowest rank's. A method that cannot run here (DeepSpeed not installed, torch's ring CP on
CPU, ...) gets the reason in the table instead of a number. Before timing, every method's
output and gradients are checked against our Ulysses (relative error in the table); the
run fails if any differs. At the largest length the op's step is also profiled and split
into attention kernels / collectives / copies / other (--profile). Results:
<out-dir>/throughput.md, throughput.csv and throughput_profile.csv, the exact command at
the top of each. The NCCL/GPU path is written against the same APIs but has only been run
on CPU.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import math
import os
import platform
import queue
import shlex
import socket
import statistics
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script: make `benchmarks` and `upipe_compile` importable
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tabulate import tabulate  # noqa: E402

import upipe_compile  # noqa: E402
from benchmarks import deepspeed_ulysses  # noqa: E402
from benchmarks.tiny_llama import Block, LlamaConfig  # noqa: E402

# Attention shapes: U = P, 2P and all heads must be distinct and divide the query heads, and
# DeepSpeed's Ulysses needs at least P KV heads (it refuses fewer).
MODELS = {
    # CPU default: 16 q / 4 KV heads of 64 (P = 2, 4)
    "tiny": LlamaConfig(vocab=512, hidden=1024, layers=1, q_heads=16, kv_heads=4, ffn=2048),
    # GPU default: Llama3-8B's block, 32 q / 8 KV heads of 128 (P = 2, 4, 8)
    "llama3-8b": LlamaConfig(vocab=512, hidden=4096, layers=1, q_heads=32, kv_heads=8, ffn=14336),
    # --quick: the tiny model's heads at head_dim 16
    "quick": LlamaConfig(vocab=512, hidden=256, layers=1, q_heads=16, kv_heads=4, ffn=512),
}

ULYSSES, UPIPE_P, UPIPE_P_NONE, UPIPE_P_BOTH, UPIPE_2P, DEEPSPEED, RING = (
    "Ulysses (ours)", "UPipe U=P", "UPipe U=P, no prefetch", "UPipe U=P, prefetch both", "UPipe U=2P",
    "DeepSpeed Ulysses", "torch ring CP")
METHODS = (ULYSSES, UPIPE_P, UPIPE_P_NONE, UPIPE_P_BOTH, UPIPE_2P, DEEPSPEED, RING)


def our_methods(q_heads: int, world: int):
    """(name, U, prefetch) of each upipe_compile configuration: Ulysses (one stage, nothing
    to prefetch), UPipe U=P with each prefetch mode (the default "forward" is plain
    "UPipe U=P"), and U=2P."""
    return ((ULYSSES, q_heads, "forward"), (UPIPE_P, world, "forward"), (UPIPE_P_NONE, world, "none"),
            (UPIPE_P_BOTH, world, "both"), (UPIPE_2P, 2 * world, "forward"))
TOLERANCE = {torch.bfloat16: 3e-2, torch.float32: 1e-4}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
COLUMNS = ["case", "P", "seq", "method", "U", "median ms", "min ms", "tokens/s",
           "vs Ulysses", "vs DeepSpeed", "max rel. err", "note"]


# --- helpers ------------------------------------------------------------------------------
def squared_norms(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """[|actual - expected|^2, |expected|^2] of this rank's part (float32 temporaries of the
    local size only: the check must fit next to a long sequence)."""
    expected = expected.float()
    return torch.stack([(actual.float() - expected).pow(2).sum(), expected.pow(2).sum()]).double()


class Rank:
    """What every rank needs: its group, device, and a progress channel (rank 0 only)."""

    def __init__(self, rank, world, device, messages, args, cfg):
        self.rank, self.world, self.device, self.messages, self.args, self.cfg = rank, world, device, messages, args, cfg
        self.dtype = DTYPES[args.dtype]
        self.mesh = torch.distributed.device_mesh.init_device_mesh(device.type, (world,), mesh_dim_names=("cp",))
        self.group = self.mesh.get_group()

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def tick(self, label: str, n: int = 1):
        if self.rank == 0:
            self.messages.put(("tick", n, label))

    def timed(self, fn):
        """Run ``fn`` after a barrier; its wall time on this rank and its result."""
        self.sync()
        dist.barrier()
        start = time.perf_counter()
        result = fn()
        self.sync()
        return time.perf_counter() - start, result

    def all_max(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def all_agree(self, ok: bool) -> bool:
        t = torch.tensor([0.0 if ok else 1.0], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item() == 0.0

    def gather_seq(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return upipe_compile.gather_sequence(t.contiguous(), self.mesh, dim=dim)

    def my_shard(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's contiguous shard of a full-sequence tensor."""
        local = full.shape[dim] // self.world
        return full.narrow(dim, self.rank * local, local)

    def relative_error(self, results, reference) -> float:
        """max over tensors of |a - e| / |e| over the whole sequence, from every rank's
        shard (replicated tensors, such as all-reduced weight gradients, give the same ratio)."""
        norms = torch.stack([squared_norms(a, e) for a, e in zip(results, reference)]).to(self.device)
        dist.all_reduce(norms)
        return (norms[:, 0] / norms[:, 1].clamp_min(1e-30)).sqrt().max().item()


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


# --- torch's ring context parallelism -----------------------------------------------------
def ring_attention_step(r: Rank, full: list[torch.Tensor], gqa: bool):
    """One forward + backward of SDPA under ``context_parallel`` (which shards the full
    [B, H, S, D] q, k, v, dout itself, head-tail load balanced). Timed inside the context
    only. Returns (seconds, (out, dq, dk, dv) over the full sequence in natural order)."""
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard

    buffers = [t.clone() for t in full]
    with context_parallel(r.mesh, buffers=buffers, buffer_seq_dims=[2] * 4, no_restore_buffers=set(buffers)):
        q, k, v = (b.detach().requires_grad_() for b in buffers[:3])

        def step():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
            out.backward(buffers[3])
            return out.detach()

        seconds, out = r.timed(step)
    results = context_parallel_unshard(r.mesh, [out, q.grad, k.grad, v.grad], [2] * 4)
    return seconds, tuple(results)


def probe_ring(r: Rank) -> str | None:
    """None when torch's ring CP runs SDPA (with GQA) here, else why not (the first line of
    the error it raises). Every rank gets the same answer."""
    cfg = r.cfg
    seq = 8 * r.world
    gen = torch.Generator().manual_seed(7)
    shapes = [(1, cfg.q_heads, seq, 16), (1, cfg.kv_heads, seq, 16), (1, cfg.kv_heads, seq, 16), (1, cfg.q_heads, seq, 16)]
    full = [torch.randn(s, generator=gen).to(r.device, r.dtype) for s in shapes]
    reason = None
    try:
        ring_attention_step(r, full, gqa=True)
    except Exception as error:  # CPU: no sharding strategy for the CPU flash kernel
        reason = first_line(error)
    if not r.all_agree(reason is None):
        reason = reason or "failed on another rank"
    return reason


# --- (a) the attention op alone -----------------------------------------------------------
def op_methods(r: Rank, seq: int, ring_reason: str | None):
    """name -> (U, step) where step() runs forward + backward and returns
    (seconds, (out, dq, dk, dv) full-sequence [B, H, S, D] for the check) -- or name -> reason."""
    cfg, world = r.cfg, r.world
    s_local, hq, hkv, d = seq // world, cfg.q_heads, cfg.kv_heads, cfg.head_dim
    gen = torch.Generator().manual_seed(1000 + r.rank)  # this rank's shard of one global tensor
    make = lambda heads: torch.randn(1, s_local, heads, d, generator=gen).to(r.device, r.dtype)  # noqa: E731
    # DeepSpeed's natural layout is [B, S/P, H, D], ours [B, H, S/P, D]: same values, each
    # method gets its own layout contiguous.
    bshd = [make(hq), make(hkv), make(hkv), make(hq)]  # q, k, v, dout
    bhsd = [t.transpose(1, 2).contiguous() for t in bshd]

    def leaves(ts):
        return [t.clone().requires_grad_() for t in ts[:3]] + [ts[3]]

    def local(out, grads, layout):
        """(out, dq, dk, dv) of this rank's shard, [B, H, S/P, D], for the check."""
        tensors = (out, *grads)
        return tuple(t.transpose(1, 2) for t in tensors) if layout == "bshd" else tensors

    methods = {}

    def ours(u, prefetch):
        q, k, v, dout = leaves(bhsd)

        def step(check=False):
            for t in (q, k, v):
                t.grad = None

            def run():
                out = upipe_compile.upipe_attention(q, k, v, is_causal=True, enable_gqa=True, cp_mesh=r.mesh,
                                                    heads_per_stage=u, prefetch=prefetch)
                out.backward(dout)
                return out.detach()

            seconds, out = r.timed(run)
            return seconds, local(out, (q.grad, k.grad, v.grad), "bhsd") if check else None

        return u, step

    for name, u, prefetch in our_methods(hq, world):
        methods[name] = ours(u, prefetch)

    reason = deepspeed_ulysses.unavailable_reason()
    if reason is None:
        attn = deepspeed_ulysses.distributed_attention(r.group)
        q, k, v, dout = leaves(bshd)

        def ds_step(check=False):
            for t in (q, k, v):
                t.grad = None

            def run():
                out = attn(q, k, v, 0)
                out.backward(dout)
                return out.detach()

            seconds, out = r.timed(run)
            return seconds, local(out, (q.grad, k.grad, v.grad), "bshd") if check else None

        methods[DEEPSPEED] = (hq, ds_step)
    else:
        methods[DEEPSPEED] = reason

    if ring_reason is None:
        full = [r.gather_seq(t, dim=2) for t in bhsd]

        def ring_step(check=False):
            seconds, results = ring_attention_step(r, full, gqa=True)
            return seconds, tuple(r.my_shard(t, 2) for t in results) if check else None

        methods[RING] = (hq, ring_step)
    else:
        methods[RING] = ring_reason
    return methods


# --- (b) the decoder block ----------------------------------------------------------------
def block_methods(r: Rank, seq: int, ring_reason: str | None):
    cfg, world, args = r.cfg, r.world, r.args
    s_local = seq // world
    torch.manual_seed(0)
    state = {k: v.to(r.dtype) for k, v in Block(cfg).state_dict().items()}
    gen = torch.Generator().manual_seed(2000 + r.rank)
    x_local = torch.randn(1, s_local, cfg.hidden, generator=gen).to(r.device, r.dtype)
    dy_local = torch.randn(1, s_local, cfg.hidden, generator=gen).to(r.device, r.dtype)
    positions = upipe_compile.global_positions(s_local, r.mesh, device=r.device)

    def fresh(model):
        model.load_state_dict(state)
        return model.to(r.device, r.dtype)

    def summary(model, y, dx):
        """(y, dx) of this rank's shard and the parameter gradients summed over ranks."""
        grads = []
        for _, p in sorted(model.named_parameters()):
            g = p.grad.detach().clone()
            dist.all_reduce(g)
            grads.append(g)
        return (y, dx, *grads)

    def sharded(model, compiled):
        x = x_local.clone().requires_grad_()

        def step(check=False):
            model.zero_grad(set_to_none=True)
            x.grad = None

            def run():
                y = compiled(x, positions)
                y.backward(dy_local)
                return y.detach()

            seconds, y = r.timed(run)
            return seconds, summary(model, y, x.grad) if check else None

        return step

    methods = {}
    for name, u, prefetch in our_methods(cfg.q_heads, world):
        model = fresh(Block(cfg))
        compiled = torch.compile(model, backend="upipe", dynamic=False, options={
            "cp_mesh": r.mesh, "heads_per_stage": u, "prefetch": prefetch, "inner_backend": args.inner_backend})
        methods[name] = (u, sharded(model, compiled))

    reason = deepspeed_ulysses.unavailable_reason()
    if reason is None:
        model = fresh(deepspeed_ulysses.deepspeed_block(cfg, r.group))
        compiled = torch.compile(model, backend=args.inner_backend, dynamic=False)
        methods[DEEPSPEED] = (cfg.q_heads, sharded(model, compiled))
    else:
        methods[DEEPSPEED] = reason

    if ring_reason is None:
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.experimental._attention import context_parallel_unshard

        model = fresh(Block(cfg))
        compiled = torch.compile(model, backend=args.inner_backend, dynamic=False)
        full = [r.gather_seq(x_local, 1), r.gather_seq(positions, 1), r.gather_seq(dy_local, 1)]

        def ring_step(check=False):
            model.zero_grad(set_to_none=True)
            buffers = [t.clone() for t in full]
            with context_parallel(r.mesh, buffers=buffers, buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(buffers)):
                x = buffers[0].detach().requires_grad_()

                def run():
                    y = compiled(x, buffers[1])
                    y.backward(buffers[2])
                    return y.detach()

                seconds, y = r.timed(run)
            if not check:
                return seconds, None
            y_full, dx_full = context_parallel_unshard(r.mesh, [y, x.grad], [1, 1])
            return seconds, summary(model, r.my_shard(y_full, 1), r.my_shard(dx_full, 1))

        methods[RING] = (cfg.q_heads, ring_step)
    else:
        methods[RING] = ring_reason
    return methods


# --- one (case, P, seq) cell --------------------------------------------------------------
def measure_cell(r: Rank, case: str, seq: int, methods: dict) -> list[dict]:
    """Warm up every runnable method (the first warm-up compiles, where there is anything to
    compile, and is checked against our Ulysses), then time the repeats interleaved."""
    args = r.args
    rows, runnable, errors, check = {}, {}, {}, {}
    for name in METHODS:
        entry = methods[name]
        rows[name] = {"case": case, "P": r.world, "seq": seq, "method": name,
                      "U": entry[0] if isinstance(entry, tuple) else None}
        if isinstance(entry, str):
            rows[name]["note"] = entry
            r.tick(f"P={r.world} S={seq} {case}", args.warmup + args.repeats)
            continue
        _, step = entry
        reason, done = None, 0
        try:
            for i in range(args.warmup):
                _, results = step(check=(i == 0))
                if i == 0:
                    check[name] = results
                done += 1
                r.tick(f"P={r.world} S={seq} {case} {name} warm-up")
        except Exception as error:  # a peer that fails here (not ours: ours must run) is reported
            if name in METHODS[:5]:  # ours
                raise
            reason = first_line(error)
        if not r.all_agree(reason is None):
            reason = reason or "failed on another rank"
        if reason is not None:
            rows[name]["note"] = reason
            check.pop(name, None)
            r.tick(f"P={r.world} S={seq} {case}", args.warmup + args.repeats - done)
            continue
        runnable[name] = step

    reference = check[ULYSSES]
    for name in [n for n in METHODS if n in check]:  # the same order on every rank
        errors[name] = r.relative_error(check[name], reference)
    del check, reference

    times = {name: [] for name in runnable}
    for _ in range(args.repeats):
        for name, step in runnable.items():  # interleaved: every method once per round
            seconds, _ = step()
            times[name].append(seconds)
            r.tick(f"P={r.world} S={seq} {case} {name}")
    for name in runnable:
        slowest = r.all_max(times[name])  # a step takes as long as its slowest rank
        median, best = statistics.median(slowest), min(slowest)
        rows[name].update({"median ms": 1e3 * median, "min ms": 1e3 * best, "tokens/s": seq / median,
                           "max rel. err": errors[name]})
    base = rows[ULYSSES]["median ms"]
    peer = rows[DEEPSPEED].get("median ms")
    for name in runnable:
        rows[name]["vs Ulysses"] = base / rows[name]["median ms"]
        if peer is not None:
            rows[name]["vs DeepSpeed"] = peer / rows[name]["median ms"]
    return [rows[name] for name in METHODS]


# --- where a step's time goes --------------------------------------------------------------
PROFILE_COLUMNS = ["case", "P", "seq", "method", "U", "step ms", "attention kernels ms", "collectives ms",
                   "copies ms", "other ms", "collective calls", "copy calls"]


def _category(name: str) -> str | None:
    if name == "c10d::barrier":
        return None  # the timing barrier, outside the timed step
    if name.startswith("aten::_scaled_dot_product"):
        return "attention kernels ms"
    if ("c10d" in name or "wait_tensor" in name or "all_to_all" in name or "alltoall" in name
            or name.startswith("_SeqAllToAll")):
        return "collectives ms"  # includes waiting for the slowest peer
    if name in ("aten::copy_", "aten::index_select", "aten::index_copy_", "aten::index_add_", "aten::add_",
                "aten::fill_", "aten::zero_", "aten::cat", "aten::stack", "aten::scatter_add_", "aten::clone",
                "aten::contiguous"):
        return "copies ms"
    return "other ms"


def profile_cell(r: Rank, case: str, seq: int, methods: dict, steps: int) -> list[dict]:
    """Each runnable method's step split by torch.profiler self time (mean over ranks and
    ``steps`` interleaved steps): attention kernels, collectives (including waiting for
    peers), copies (packing, unpacking, accumulating), other (allocation, autograd, Python)."""
    from torch.profiler import ProfilerActivity, profile

    names = [n for n in METHODS if n != RING and isinstance(methods[n], tuple)]
    r.tick(f"profile P={r.world} S={seq} {case}", (len(METHODS) - 1 - len(names)) * steps)  # not run
    sums = {n: {c: 0.0 for c in PROFILE_COLUMNS[5:]} for n in names}
    for n in names:
        methods[n][1]()  # one untimed step (compiles where needed)
    for _ in range(steps):
        for n in names:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                seconds, _ = methods[n][1]()
            acc = sums[n]
            acc["step ms"] += 1e3 * seconds
            for event in prof.key_averages():
                category = _category(event.key)
                if category is None:
                    continue
                acc[category] += event.self_cpu_time_total / 1e3
                if category == "collectives ms" and ("alltoall" in event.key or "allgather" in event.key):
                    acc["collective calls"] += event.count
                if category == "copies ms":
                    acc["copy calls"] += event.count
            r.tick(f"profile P={r.world} S={seq} {case} {n}")
    rows = []
    for n in names:
        acc = sums[n]
        measured = sum(acc[c] for c in ("attention kernels ms", "collectives ms", "copies ms", "other ms"))
        acc["other ms"] += acc["step ms"] - measured  # Python and anything the profiler does not see
        values = [acc[c] / steps for c in PROFILE_COLUMNS[5:]]
        t = torch.tensor(values, dtype=torch.float64, device=r.device)
        dist.all_reduce(t)
        mean = (t / r.world).tolist()
        row = {"case": case, "P": r.world, "seq": seq, "method": n, "U": methods[n][0]}
        row.update(dict(zip(PROFILE_COLUMNS[5:], mean)))
        rows.append(row)
    return rows


# --- compile time -------------------------------------------------------------------------
def measure_compile_time(r: Rank, seq: int) -> list[dict]:
    """First call (compile + run) minus a steady step, for torch.compile(backend="upipe")
    and the plain inner backend on the same block and the same local shard. Cold: a fresh
    inductor cache dir and cleared in-memory caches (torch._inductor.utils.fresh_cache);
    warm: compiled again after torch._dynamo.reset() with that cache kept."""
    from torch._inductor.utils import fresh_cache

    cfg, world, backend = r.cfg, r.world, r.args.compile_backend
    s_local = seq // world
    torch.manual_seed(0)
    state = {k: v.to(r.dtype) for k, v in Block(cfg).state_dict().items()}
    gen = torch.Generator().manual_seed(3000 + r.rank)
    x = torch.randn(1, s_local, cfg.hidden, generator=gen).to(r.device, r.dtype).requires_grad_()
    dy = torch.randn(1, s_local, cfg.hidden, generator=gen).to(r.device, r.dtype)
    positions = upipe_compile.global_positions(s_local, r.mesh, device=r.device)

    def one(name):
        torch._dynamo.reset()
        model = Block(cfg)
        model.load_state_dict(state)
        model = model.to(r.device, r.dtype)
        if name == "upipe":
            compiled = torch.compile(model, backend="upipe", dynamic=False, options={
                "cp_mesh": r.mesh, "heads_per_stage": world, "inner_backend": backend})
        else:
            compiled = torch.compile(model, backend=backend, dynamic=False)

        def run():
            model.zero_grad(set_to_none=True)
            compiled(x, positions).backward(dy)

        first, _ = r.timed(run)
        steady = statistics.median(r.timed(run)[0] for _ in range(2))
        first, steady = r.all_max([first, steady])
        return first, steady

    # Load the compiler's modules once, so that neither measurement pays for importing them.
    with fresh_cache():
        torch._dynamo.reset()
        warm_up = torch.compile(lambda t: (t.sin() * 2).sum(), backend=backend)
        x_small = torch.randn(8, device=r.device, requires_grad=True)
        warm_up(x_small).backward()
    rows = []
    label = {"upipe": f'backend="upipe" (inner {backend}, U=P={world})', backend: f'backend="{backend}" (no CP)'}
    for name in (backend, "upipe"):
        with fresh_cache():
            cold_first, cold_steady = one(name)
            r.tick(f"compile time {name} cold")
            warm_first, warm_steady = one(name)
            r.tick(f"compile time {name} warm")
        rows.append({"compile": label[name], "P": world, "seq": seq,
                     "cold: first call s": cold_first, "cold: compile s": cold_first - cold_steady,
                     "warm: first call s": warm_first, "warm: compile s": warm_first - warm_steady,
                     "steady step ms": 1e3 * min(cold_steady, warm_steady)})
    torch._dynamo.reset()
    base = rows[0]["cold: compile s"]
    rows[1]["cold: compile vs plain"] = rows[1]["cold: compile s"] / base
    rows[0]["cold: compile vs plain"] = 1.0
    return rows


# --- a rank -------------------------------------------------------------------------------
def rank_main(rank: int, world: int, port: int, args, messages, with_compile_time: bool) -> None:
    try:
        device = torch.device(args.device if args.device == "cpu" else f"cuda:{rank}")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        torch.set_num_threads(args.threads)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo" if device.type == "cpu" else "nccl", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=world, timeout=datetime.timedelta(seconds=args.timeout))
        r = Rank(rank, world, device, messages, args, MODELS[args.model])
        ds_reason = deepspeed_ulysses.init("gloo" if device.type == "cpu" else "nccl")
        available = torch.tensor([float(ds_reason is None)], device=device)
        dist.all_reduce(available)
        if 0 < available.item() < world:
            raise RuntimeError(f"deepspeed initialised on some ranks only; here: {ds_reason}")
        ring_reason = probe_ring(r)
        rows = []
        for seq in args.seqs:
            if "op" in args.cases:
                rows += measure_cell(r, "op", seq, op_methods(r, seq, ring_reason))
            if "block" in args.cases:
                torch._dynamo.reset()  # drop the previous length's graphs
                rows += measure_cell(r, "block", seq, block_methods(r, seq, ring_reason))
        profile_rows = []
        if args.profile and "op" in args.cases:
            torch._dynamo.reset()
            seq = max(args.seqs)
            profile_rows += profile_cell(r, "op", seq, op_methods(r, seq, "skipped"), args.profile)
        compile_rows = measure_compile_time(r, args.seqs[0]) if with_compile_time else []
        if rank == 0:
            messages.put(("rows", rows, profile_rows, compile_rows, ds_reason, ring_reason))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        messages.put(("error", rank, traceback.format_exc()))
        raise


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def inductor_cache_base() -> str:
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return os.environ["TORCHINDUCTOR_CACHE_DIR"]
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return default_cache_dir()


def run_world(world: int, args, bar, with_compile_time: bool):
    ctx = mp.get_context("spawn")
    messages = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, args, messages, with_compile_time))
             for r in range(world)]
    # One inductor cache per P. upipe::attention's fake kernel reads P from the process
    # group, which is not part of inductor's FX-graph / AOTAutograd cache keys: with a shared
    # cache, a block compiled at P=2 is reused at P=4 when the local shapes match
    # (P=2, S=2048 vs P=4, S=4096) and fails its size asserts on the op's lse output.
    saved = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(inductor_cache_base(), f"upipe-throughput-P{world}")
    try:
        for p in procs:
            p.start()
    finally:
        if saved is None:
            del os.environ["TORCHINDUCTOR_CACHE_DIR"]
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = saved
    try:
        while True:
            try:
                message = messages.get(timeout=5)
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise SystemExit(f"P={world}: a rank exited with code {dead[0].exitcode} and reported nothing")
                continue
            if message[0] == "tick":
                bar.set_description(message[2], refresh=False)
                bar.update(message[1])
            elif message[0] == "error":
                raise SystemExit(f"P={world}: rank {message[1]} failed:\n{message[2]}")
            else:
                _, rows, profile_rows, compile_rows, ds_reason, ring_reason = message
                break
        for p in procs:
            p.join(timeout=120)
        return rows, profile_rows, compile_rows, ds_reason, ring_reason
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()


# --- the report ---------------------------------------------------------------------------
def command_line() -> str:
    exe = os.path.relpath(sys.executable) if sys.executable.startswith(os.getcwd() + os.sep) else "python"
    return shlex.join([exe, *sys.argv])


def fmt_rows(rows, header_notes=()):
    """Rows as table cells; a reason already given in the header is not repeated per row."""
    out = []
    for row in rows:
        if row.get("note") and row["note"] in header_notes:
            row = {**row, "note": "not run: see the header"}
        shown = {}
        for key in COLUMNS:
            value = row.get(key)
            if isinstance(value, float):
                value = (f"{value:.2e}" if key == "max rel. err" else f"{value:.3f}" if key.startswith("vs")
                         else f"{value:.0f}" if key == "tokens/s" else f"{value:.1f}")
            shown[key] = "" if value is None else value
        out.append(shown)
    return out


def goals(rows, seqs) -> list[str]:
    """The issue's goals at the largest length: Ulysses (ours) >= 1.0x DeepSpeed; UPipe U=P
    >= 0.95x of both (throughput ratios)."""
    lines = []
    largest = max(seqs)
    for case in ("op", "block"):
        for world in sorted({row["P"] for row in rows}):
            cell = {row["method"]: row for row in rows if row["case"] == case and row["P"] == world and row["seq"] == largest}
            if not cell:
                continue
            ours, upipe, peer = cell[ULYSSES], cell[UPIPE_P], cell[DEEPSPEED]
            parts = [f"{case:5s} P={world} S={largest}:"]
            if "median ms" in peer:
                a = ours["vs DeepSpeed"]
                parts.append(f"Ulysses(ours)/DeepSpeed = {a:.3f}x (goal >= 1.0: {'met' if a >= 1.0 else 'MISSED'});")
                b = upipe["vs DeepSpeed"]
                parts.append(f"UPipe(U=P)/DeepSpeed = {b:.3f}x (goal >= 0.95: {'met' if b >= 0.95 else 'MISSED'});")
            else:
                parts.append(f"DeepSpeed: {peer.get('note', 'not run')};")
            c = upipe["vs Ulysses"]
            parts.append(f"UPipe(U=P)/Ulysses(ours) = {c:.3f}x (goal >= 0.95: {'met' if c >= 0.95 else 'MISSED'})")
            lines.append(" ".join(parts))
    return lines


class _PlainProgress:
    """The part of tqdm's interface used here, printing one line per update to stderr."""

    def __init__(self, total=0, file=sys.stderr, **_):
        self.total, self.n, self.file, self.desc = total, 0, file, ""

    def __enter__(self):
        return self

    def __exit__(self, *_):
        return False

    def refresh(self):
        pass

    def set_description(self, desc, refresh=True):
        self.desc = desc

    def update(self, n=1):
        self.n += n
        print(f"[{self.n}/{self.total}] {self.desc}", file=self.file, flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4], help="context-parallel sizes P (default: 2 4)")
    parser.add_argument("--seqs", type=int, nargs="+", default=None,
                        help="full sequence lengths (default: 2048 4096 8192; --quick: 256)")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per method (default 5; --quick: 2)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per method before timing; the first "
                                                               "compiles and is checked (default 1)")
    parser.add_argument("--cases", nargs="+", choices=["op", "block"], default=["op", "block"])
    parser.add_argument("--model", choices=sorted(MODELS), default=None,
                        help="attention heads and block size: tiny (CPU default), llama3-8b (GPU default), "
                             "quick (--quick)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--tolerance", type=float, default=None,
                        help="largest relative error vs Ulysses (ours) that passes (default 3e-2 for bf16, 1e-4 for "
                             "fp32; in bf16 the CPU kernel's own dK/dV error grows with the length, Ulysses' most: "
                             "1.4e-2 vs fp32 at 8192 tokens)")
    parser.add_argument("--inner-backend", default=None, choices=["inductor", "aot_eager", "eager"],
                        help="compiles the block (ours inside backend='upipe', the peers directly); "
                             "default inductor, --quick: aot_eager")
    parser.add_argument("--compile-time", action=argparse.BooleanOptionalAction, default=True,
                        help="measure compile time of backend='upipe' vs the plain inner backend (on the first P)")
    parser.add_argument("--compile-backend", default=None, choices=["inductor", "aot_eager"],
                        help="the inner backend for the compile-time comparison (default inductor; --quick: aot_eager)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="auto: cuda with NCCL when there is a GPU per rank, else cpu with gloo")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: cores // P, at least 1)")
    parser.add_argument("--timeout", type=int, default=900, help="process-group timeout, seconds")
    parser.add_argument("--profile", type=int, default=2, metavar="STEPS",
                        help="profile STEPS steps of each op method at the largest length, per P, and split the "
                             "time into attention kernels / collectives / copies / other (default 2; 0: off)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: the quick model (hidden 256, 16 q / 4 KV heads of 16), aot_eager, "
                             "256 tokens, 2 repeats (explicit flags still win)")
    parser.add_argument("--out-dir", default=os.path.join(ROOT, "benchmarks", "results"))
    args = parser.parse_args(argv)

    args.seqs = args.seqs or ([256] if args.quick else [2048, 4096, 8192])
    args.repeats = args.repeats or (2 if args.quick else 5)
    args.inner_backend = args.inner_backend or ("aot_eager" if args.quick else "inductor")
    args.compile_backend = args.compile_backend or ("aot_eager" if args.quick else "inductor")
    if args.warmup < 1:
        parser.error("--warmup must be at least 1 (the first warm-up step is the correctness check)")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= max(args.world) else "cpu"
    args.model = args.model or ("quick" if args.quick else "llama3-8b" if args.device == "cuda" else "tiny")
    cfg = MODELS[args.model]
    for world in args.world:
        for seq in args.seqs:
            if seq % world:
                parser.error(f"sequence length {seq} is not divisible by P={world}")
        if cfg.q_heads % (2 * world):
            parser.error(f"P={world}: U=2P={2 * world} must divide the {cfg.q_heads} query heads")
    cores = torch.get_num_threads()
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # P ranks compile at once: no worker pools
    command = command_line()

    try:
        from tqdm import tqdm
    except ImportError:  # the bench extra brings tqdm; without it, a plain line per update
        tqdm = _PlainProgress

    started = time.perf_counter()
    rows, profile_rows, compile_rows, notes = [], [], [], {}
    with tqdm(total=0, file=sys.stderr, unit="step", dynamic_ncols=True, mininterval=1.0) as bar:
        for index, world in enumerate(args.world):
            args_world = argparse.Namespace(**vars(args))
            args_world.threads = args.threads or max(1, cores // world)
            n_methods = len(METHODS) * len(args.cases) * len(args.seqs) * (args.warmup + args.repeats)
            bar.total += (n_methods + (4 if (index == 0 and args.compile_time) else 0)
                          + (len(METHODS) - 1) * args.profile * ("op" in args.cases))
            bar.refresh()
            world_rows, world_profile, world_compile, ds_reason, ring_reason = run_world(
                world, args_world, bar, with_compile_time=(index == 0 and args.compile_time))
            rows += world_rows
            profile_rows += world_profile
            compile_rows += world_compile
            notes[world] = (args_world.threads, ds_reason, ring_reason)
    wall = time.perf_counter() - started

    threads = ", ".join(f"P={w}: {t}" for w, (t, _, _) in notes.items())
    ds_reason = next((d for _, d, _ in notes.values() if d), None)
    ring_reason = next((rr for _, _, rr in notes.values() if rr), None)
    try:
        ds_text = f"deepspeed {deepspeed_ulysses.version()}" if ds_reason is None else "deepspeed not available"
    except Exception:
        ds_text = ds_reason or "deepspeed ?"
    tol = args.tolerance if args.tolerance is not None else TOLERANCE[DTYPES[args.dtype]]
    worst = max((row["max rel. err"] for row in rows if "max rel. err" in row), default=0.0)
    ok = worst <= tol
    device_text = (f"{args.device} ({torch.cuda.get_device_name(0)}), NCCL" if args.device == "cuda"
                   else f"CPU ({cores} cores, {platform.processor() or platform.machine()}), gloo")
    header = [
        f"$ {command}",
        "",
        f"# {datetime.datetime.now().isoformat(timespec='seconds')}; torch {torch.__version__}; {ds_text}; "
        f"device {device_text}; torch threads per rank {threads}"
        + (" (P ranks share the cores: oversubscribed when P > cores)" if args.device == "cpu" else ""),
        f"# attention ({args.model}): {cfg.q_heads} q / {cfg.kv_heads} KV heads, head_dim {cfg.head_dim}, causal, batch 1, {args.dtype}"
        + (" (CPU flash kernel; bf16 runs on AMX where present)" if args.device == "cpu" else ""),
        f"# block: benchmarks/tiny_llama.Block ({cfg}), compiled with inner backend {args.inner_backend} "
        f"(ours: backend='upipe', options inner_backend={args.inner_backend!r}; peers: backend={args.inner_backend!r})",
        f"# timing: {args.warmup} warm-up step(s) (the first compiles and is checked), then the median of {args.repeats} "
        "forward+backward steps, methods interleaved step by step; a step = the slowest rank's time",
        "# vs Ulysses / vs DeepSpeed: throughput ratio (their median time / this one's; > 1 = faster)",
        f"# max rel. err: output and every gradient vs Ulysses (ours), max over tensors and ranks; tolerance {tol:g}",
        f"# torch ring CP: {'runs' if ring_reason is None else 'does not run here: ' + ring_reason}",
        f"# DeepSpeed Ulysses: {'runs' if ds_reason is None else 'does not run here: ' + ds_reason}",
        f"# wall time of this run: {wall:.0f} s",
    ]
    sections = []
    for case, title in (("op", "Attention op alone (forward + backward)"),
                        ("block", "Llama-style decoder block (forward + backward)")):
        case_rows = [row for row in rows if row["case"] == case]
        if case_rows:
            shown = fmt_rows(case_rows, header_notes=[n for n in (ds_reason, ring_reason) if n])
            sections += [f"## {title}", "", tabulate(shown, headers="keys", tablefmt="github", disable_numparse=True), ""]
    if profile_rows:
        sections += [f"## Where the op's step goes (torch.profiler self time, mean over ranks and {args.profile} steps, "
                     f"S={max(args.seqs)})", "",
                     "collectives include waiting for the slowest peer; copies = packing/unpacking/accumulating "
                     "(copy_, index_select, index_copy_/add_, add_, fill_/zero_, cat/stack, clone); other = the "
                     "step's wall time minus those (allocation, autograd, Python).", "",
                     tabulate([{k: row[k] for k in PROFILE_COLUMNS} for row in profile_rows], headers="keys",
                              tablefmt="github", floatfmt=".1f"), ""]
    if compile_rows:
        sections += [f"## Compile time of the block: backend=\"upipe\" vs plain {args.compile_backend}", "",
                     "compile s = first call (trace, compile, run forward + backward) minus a steady step; cold: a "
                     "fresh inductor cache dir and cleared in-memory caches (torch._inductor.utils.fresh_cache), "
                     "warm: compiled again after torch._dynamo.reset() with that cache kept. The plain row is the "
                     "same block without context parallelism (attention over the local shard only), so its steady "
                     "step is not comparable; max over ranks.", "",
                     tabulate(compile_rows, headers="keys", tablefmt="github", floatfmt=".2f"), ""]
    verdict = [f"CHECK {'OK' if ok else 'FAILED'}: every method's output and gradients match Ulysses (ours) "
               f"(max rel. err {worst:.2e}, tolerance {tol:g})"]
    goal_lines = goals(rows, args.seqs)
    text = "\n".join(header + [""] + sections + ["## Goals at the largest length", ""] + goal_lines + [""] + verdict) + "\n"

    os.makedirs(args.out_dir, exist_ok=True)
    md_path = os.path.join(args.out_dir, "throughput.md")
    csv_path = os.path.join(args.out_dir, "throughput.csv")
    with open(md_path, "w") as f:
        f.write(text)
    with open(csv_path, "w", newline="") as f:
        f.write(f"# $ {command}\n")
        writer = csv.DictWriter(f, fieldnames=COLUMNS + ["dtype", "inner backend", "device"])
        writer.writeheader()
        for row in rows:
            writer.writerow({**{k: row.get(k, "") for k in COLUMNS}, "dtype": args.dtype,
                             "inner backend": args.inner_backend if row["case"] == "block" else "",
                             "device": args.device})
        for row in compile_rows:
            writer.writerow({"case": "compile", "P": row["P"], "seq": row["seq"], "method": row["compile"],
                             "median ms": row["cold: compile s"] * 1e3,
                             "note": f"cold compile (first call - steady step); warm {row['warm: compile s']:.2f} s",
                             "dtype": args.dtype, "inner backend": args.compile_backend, "device": args.device})
    written = [md_path, csv_path]
    if profile_rows:
        profile_path = os.path.join(args.out_dir, "throughput_profile.csv")
        with open(profile_path, "w", newline="") as f:
            f.write(f"# $ {command}\n")
            writer = csv.DictWriter(f, fieldnames=PROFILE_COLUMNS)
            writer.writeheader()
            writer.writerows({k: row[k] for k in PROFILE_COLUMNS} for row in profile_rows)
        written.append(profile_path)
    print(text)
    print("wrote " + ", ".join(written))
    if not ok:
        raise SystemExit(1)
    if any(not math.isfinite(row.get("median ms", 1.0)) for row in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
