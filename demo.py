"""upipe-compile demo: a small Llama-style model on P=4 gloo ranks (CPU), compiled with
backend="upipe", forward + backward, checked against eager on the full sequence; then
Ulysses (U = all heads) vs UPipe (U = P) side by side. Last, what UPipe is for: per-rank
memory of Llama3-8B's and a 64-head model's attention at 1M tokens on 8 ranks, Ulysses vs
UPipe, measured in seconds on fake tensors over a fake process group.

    python demo.py [--world 4] [--seq 2048] [--inner-backend inductor] [--memory-seq 1048576]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from tabulate import tabulate

# `benchmarks/` sits beside this file. Python puts a script's folder on sys.path, except in
# safe-path mode (-P, -I, PYTHONSAFEPATH): put it there so the demo runs from any folder either way.
HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import upipe_compile  # noqa: E402
from benchmarks.memory import HEAD_DIM, PRESETS, measure_layer, upipe  # noqa: E402
from benchmarks.tiny_llama import LlamaConfig, build  # noqa: E402
from upipe_compile.attention.kernels import DEFAULT_CUDA_KERNEL  # noqa: E402
from upipe_compile.launch import report, run_on_ranks  # noqa: E402
from upipe_compile.measure.memory import fake_process_group, measure_op_memory  # noqa: E402
from upipe_compile.options import DEFAULT_FUSE_PROJECTIONS  # noqa: E402

CONFIG = LlamaConfig(vocab=512, hidden=256, layers=2, q_heads=8, kv_heads=2, ffn=512)
# Real attention shapes for the memory table, where UPipe's saving shows: Llama3-8B
# (32 q / 8 KV heads, head_dim 128) and a 64-head one (Qwen3-32B, 64 q / 8 KV heads).
AT_SCALE = [preset for preset in PRESETS if preset.name in ("Llama3-8B", "Qwen3-32B")]


def relative_error(actual, expected) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


def fwd_bwd(model, tokens, positions, dout):
    model.zero_grad(set_to_none=True)
    logits = model(tokens, positions)
    logits.backward(dout)
    return logits.detach()


def say(message: str) -> None:
    """Progress on stderr (stdout carries only the result table)."""
    print(message, file=sys.stderr, flush=True)


def rank_main(args) -> list[dict]:
    """On every rank: the eager reference, then each method compiled, checked and timed."""
    rank, world = dist.get_rank(), dist.get_world_size()
    progress = report if rank == 0 else (lambda message: None)
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, CONFIG.vocab, (1, args.seq), generator=gen)
    positions = torch.arange(args.seq).unsqueeze(0)
    dout = torch.randn(1, args.seq, CONFIG.vocab, generator=gen)

    # The reference: eager attention over the full, unsharded sequence.
    progress(f"eager reference on the full {args.seq}-token sequence")
    reference = build(CONFIG)
    ref_logits = fwd_bwd(reference, tokens, positions, dout)
    ref_grads = {n: p.grad.clone() for n, p in reference.named_parameters()}

    # What a user feeds each rank: its contiguous shard, with global positions.
    shard = lambda t: upipe_compile.shard_sequence(t, mesh, dim=1)  # noqa: E731
    my_tokens, my_positions, my_dout = shard(tokens), shard(positions), shard(dout)

    rows = []
    for method, heads_per_stage in [("Ulysses", CONFIG.q_heads), ("UPipe", world)]:
        model = build(CONFIG)
        compiled = torch.compile(model, backend="upipe", options={
            "cp_mesh": mesh, "heads_per_stage": heads_per_stage, "inner_backend": args.inner_backend})
        progress(f"{method} (U={heads_per_stage}): compiling with backend=\"upipe\" "
                 f"(inner {args.inner_backend}) and running the first step")
        start = time.perf_counter()
        logits = fwd_bwd(compiled, my_tokens, my_positions, my_dout)
        compile_s = time.perf_counter() - start
        progress(f"{method} (U={heads_per_stage}): first step took {compile_s:.1f} s; timing {args.repeats} more")
        times = []
        for _ in range(args.repeats):
            dist.barrier()
            start = time.perf_counter()
            fwd_bwd(compiled, my_tokens, my_positions, my_dout)
            times.append(time.perf_counter() - start)
        full_logits = upipe_compile.gather_sequence(logits, mesh, dim=1)
        grad_error = 0.0
        for name, p in model.named_parameters():
            grad = p.grad.clone()
            dist.all_reduce(grad)  # each rank's gradient covers its shard of the sequence
            grad_error = max(grad_error, relative_error(grad, ref_grads[name]))
        rows.append({
            "method": method, "U": heads_per_stage,
            "logits rel. err": relative_error(full_logits, ref_logits),
            "max grad rel. err": grad_error,
            "first call (compile) s": compile_s,
            "fwd+bwd ms (median)": 1000 * statistics.median(times),
        })
    return rows


def op_peak_gib(group, preset, seq: int, heads_per_stage: int) -> float:
    """One rank's attention-op peak beyond its inputs and outputs, forward + backward."""
    return measure_op_memory(group, seq=seq, q_heads=preset.q_heads, kv_heads=preset.kv_heads, head_dim=HEAD_DIM,
                             heads_per_stage=heads_per_stage, cuda_kernel=DEFAULT_CUDA_KERNEL).peak_bytes / 2**30


def layer_peak_gib(group, preset, seq: int, heads_per_stage: int, fused: bool) -> float:
    """One rank's activation peak of the whole attention layer (projections, RoPE, attention,
    output projection), forward + backward; ``fused``: through the fused block op."""
    attention = ("fused", group, heads_per_stage) if fused else upipe(heads_per_stage, group)
    return measure_layer(preset, seq, group.size(), attention, DEFAULT_CUDA_KERNEL) / 2**30


def memory_row(preset, measured: str, ulysses_gib: float, upipe_gib: float, heads_per_stage: int) -> dict:
    return {"model": preset.name, "Hq / Hkv": f"{preset.q_heads} / {preset.kv_heads}", "measured": measured,
            "Ulysses GiB": ulysses_gib, f"UPipe U={heads_per_stage} GiB": upipe_gib,
            "UPipe / Ulysses": upipe_gib / ulysses_gib}


def memory_at_scale(world: int, seq: int, progress) -> list[dict]:
    """Ulysses (U = all q heads) vs UPipe (U = P, the default) per rank at real shapes, on fake
    tensors: the attention op, and the whole layer (as compiled by default: the fused block
    when it is on; Ulysses is the plain layer, as in benchmarks/fused_memory.py)."""
    layer_kind = "attention layer, fused block" if DEFAULT_FUSE_PROJECTIONS else "attention layer"
    rows = []
    with fake_process_group(world) as group:
        for preset in AT_SCALE:
            progress(f"{preset.name}: measuring its attention at {seq} tokens on {world} fake ranks")
            rows.append(memory_row(preset, "attention op", op_peak_gib(group, preset, seq, preset.q_heads),
                                   op_peak_gib(group, preset, seq, world), world))
            rows.append(memory_row(preset, layer_kind,
                                   layer_peak_gib(group, preset, seq, preset.q_heads, fused=False),
                                   layer_peak_gib(group, preset, seq, world, fused=DEFAULT_FUSE_PROJECTIONS), world))
    return rows


def print_check_table(rows: list[dict], args) -> None:
    """The tiny model on real gloo ranks: agreement with eager, and CPU times."""
    ulysses_ms = rows[0]["fwd+bwd ms (median)"]
    for row in rows:
        row["time vs Ulysses"] = row["fwd+bwd ms (median)"] / ulysses_ms
    print(f"# {CONFIG}\n# P={args.world} gloo ranks on CPU, {args.seq} tokens, inner backend {args.inner_backend}")
    print(tabulate(rows, headers="keys", floatfmt=".3g", tablefmt="github"))
    print(f"# times: {args.world} ranks share {os.cpu_count()} CPU cores at {args.seq} tokens, so they measure "
          f"core contention and UPipe's extra per-stage collectives, not speed (GPUs: docs/results.md#speed)")


def print_memory_table(rows: list[dict], args) -> None:
    print(f"\n# What UPipe is for: per-rank memory, forward + backward, {args.memory_seq} tokens on "
          f"P={args.memory_world}, bf16, {DEFAULT_CUDA_KERNEL} backward workspace counted (fake tensors, fake "
          f"process group)\n# attention op: peak beyond its inputs and outputs; attention layer: activation "
          f"peak, projections included")
    print(tabulate(rows, headers="keys", floatfmt=".3f", tablefmt="github"))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048, help="full sequence length (sharded over the ranks)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--inner-backend", default="inductor", choices=["inductor", "aot_eager", "eager"])
    parser.add_argument("--memory-seq", type=int, default=2**20, help="tokens for the fake-tensor memory table")
    parser.add_argument("--memory-world", type=int, default=8, help="ranks for the fake-tensor memory table")
    args = parser.parse_args()

    say(f"starting {args.world} gloo ranks")
    threads = max(1, torch.get_num_threads() // args.world)
    rows = run_on_ranks(args.world, rank_main, args, on_report=lambda rank, message: say(message),
                        threads=threads, timeout_s=1800, group_timeout_s=300)[0]
    print_check_table(rows, args)
    worst = max(max(r["logits rel. err"], r["max grad rel. err"]) for r in rows)
    if worst > 1e-4:
        raise SystemExit(f"FAIL: compiled model differs from eager (relative error {worst:.2e})")
    print(f"OK: logits and all parameter gradients match eager on the full sequence (max rel. error {worst:.1e})")
    print_memory_table(memory_at_scale(args.memory_world, args.memory_seq, progress=say), args)


if __name__ == "__main__":
    main()
