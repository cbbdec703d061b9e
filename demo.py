"""upipe-compile demo: a small Llama-style model on P=4 gloo ranks (CPU), compiled with
backend="upipe", forward + backward, checked against eager on the full sequence; then
Ulysses (U = all heads) vs UPipe (U = P) side by side.

    python demo.py [--world 4] [--seq 2048] [--inner-backend inductor]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist
from tabulate import tabulate

import upipe_compile
from benchmarks.tiny_llama import LlamaConfig, build
from upipe_compile.launch import report, run_on_ranks
from upipe_compile.measure.memory import fake_process_group, measure_op_memory

CONFIG = LlamaConfig(vocab=512, hidden=256, layers=2, q_heads=8, kv_heads=2, ffn=512)


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


def attention_memory_at_scale(world: int, seq: int) -> dict[int, float]:
    """Per-rank attention-op peak (GiB) for this architecture at ``seq`` tokens, measured on
    fake tensors over a fake process group, with the CPU kernels this demo runs (no CUDA
    kernel workspace)."""
    with fake_process_group(world) as group:
        return {
            u: measure_op_memory(group, seq=seq, q_heads=CONFIG.q_heads, kv_heads=CONFIG.kv_heads,
                                 head_dim=CONFIG.head_dim, heads_per_stage=u, cuda_kernel=None).peak_bytes / 2**30
            for u in (CONFIG.q_heads, world)
        }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048, help="full sequence length (sharded over the ranks)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--inner-backend", default="inductor", choices=["inductor", "aot_eager", "eager"])
    parser.add_argument("--memory-seq", type=int, default=2**20)
    args = parser.parse_args()

    say(f"starting {args.world} gloo ranks")
    threads = max(1, torch.get_num_threads() // args.world)
    rows = run_on_ranks(args.world, rank_main, args, on_report=lambda rank, message: say(message),
                        threads=threads, timeout_s=1800, group_timeout_s=300)[0]
    say(f"measuring the attention op's memory at {args.memory_seq} tokens on fake tensors")
    memory = attention_memory_at_scale(args.world, args.memory_seq)
    ulysses_ms, ulysses_mem = rows[0]["fwd+bwd ms (median)"], memory[CONFIG.q_heads]
    for row in rows:
        row["time vs Ulysses"] = row["fwd+bwd ms (median)"] / ulysses_ms
        row[f"attn GiB/rank @{args.memory_seq} tok"] = memory[row["U"]]
        row["memory vs Ulysses"] = memory[row["U"]] / ulysses_mem
    print(f"# {CONFIG}\n# P={args.world} gloo ranks on CPU, {args.seq} tokens, inner backend {args.inner_backend}; "
          f"memory: attention op peak beyond inputs/outputs, bf16, fake tensors")
    print(tabulate(rows, headers="keys", floatfmt=".3g", tablefmt="github"))
    worst = max(max(r["logits rel. err"], r["max grad rel. err"]) for r in rows)
    if worst > 1e-4:
        raise SystemExit(f"FAIL: compiled model differs from eager (relative error {worst:.2e})")
    print(f"OK: logits and all parameter gradients match eager on the full sequence (max rel. error {worst:.1e})")


if __name__ == "__main__":
    main()
