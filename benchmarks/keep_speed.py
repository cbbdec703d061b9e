"""Training-step speed under full activation checkpointing, with and without keep_attention
(CPU, gloo).

    python benchmarks/keep_speed.py [--world 2] [--seq 8192] [--layers 2] [--steps 5] [--out FILE]

A stack of Llama-style decoder blocks (benchmarks/tiny_llama.py: hidden 256, 8 q / 2 kv
heads of 32, causal, fp32), each block under ``torch.utils.checkpoint`` (full AC), compiled
with ``backend="upipe"`` (inner backend aot_eager) on P real gloo ranks; one step is the
forward and backward of the stack on this rank's shard. Methods: our Ulysses (U = all heads)
and UPipe (U = P), each with plain full AC and with ``keep_attention`` (the recompute in
backward skips attention). The methods alternate step by step (interleaved); each step's
time is the slowest rank's, and the table reports the median and the ratio to Ulysses with
full AC. On CPU every rank shares two cores; attention is most of a step from about 8K
tokens at this width.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from tabulate import tabulate

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report import emit  # noqa: E402
from upipe_compile.launch import RankPool  # noqa: E402

METHODS = {  # name -> (U is all heads, keep attention)
    "Ulysses, full AC": (True, False),
    "UPipe, full AC": (False, False),
    "Ulysses + keep_attention": (True, True),
    "UPipe + keep_attention": (False, True),
}
_STEPS: dict = {}  # per rank process: (method, seq, layers) -> one step, compiled once (each its own graphs)


def _build(method: str, seq: int, layers: int):
    import torch.distributed as dist
    import torch.nn as nn
    import torch.utils.checkpoint as checkpoint

    import upipe_compile
    from benchmarks.tiny_llama import Block, LlamaConfig
    from upipe_compile.stack.keep_attention import keep_attention

    all_heads, keep = METHODS[method]
    cfg = LlamaConfig(layers=layers)
    world = dist.get_world_size()
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block(cfg) for _ in range(layers))
    kwargs = {"use_reentrant": False, **({"context_fn": keep_attention} if keep else {})}

    def stack(x, positions):
        for block in blocks:
            x = checkpoint.checkpoint(block, x, positions, **kwargs)
        return x

    compiled = torch.compile(stack, backend="upipe", options={
        "inner_backend": "aot_eager", "heads_per_stage": cfg.q_heads if all_heads else world})
    gen = torch.Generator().manual_seed(1)
    x, dout = (upipe_compile.shard_sequence(torch.randn(1, seq, cfg.hidden, generator=gen), dim=1) for _ in range(2))
    positions = upipe_compile.global_positions(x.shape[1])

    def step() -> float:
        leaf = x.detach().requires_grad_()
        dist.barrier()
        start = time.perf_counter()
        compiled(leaf, positions).backward(dout)
        return time.perf_counter() - start

    return step


def _step(method: str, seq: int, layers: int) -> float:
    key = (method, seq, layers)
    if key not in _STEPS:
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 4 * len(METHODS))
        _STEPS[key] = _build(method, seq, layers)
    return _STEPS[key]()


def run(world: int, seq: int, layers: int, steps: int) -> list[dict]:
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    with RankPool(world, threads=1, timeout_s=3600) as pool:
        for method in METHODS:  # warm-up: compile, then one run of the compiled step
            pool.run(_step, method, seq, layers)
            pool.run(_step, method, seq, layers)
        for _ in range(steps):  # interleaved: each method once per round
            for method in METHODS:
                times[method].append(max(pool.run(_step, method, seq, layers)))
    base = statistics.median(times["Ulysses, full AC"])
    return [{"method": m, "step_s": statistics.median(t), "throughput vs Ulysses, full AC": base / statistics.median(t)}
            for m, t in times.items()]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", help="also write the table to this markdown file")
    args = parser.parse_args(argv)
    rows = run(args.world, args.seq, args.layers, args.steps)
    command = " ".join(["python benchmarks/keep_speed.py", *(argv if argv is not None else sys.argv[1:])])
    text = (f"# {command}\n# P={args.world} gloo ranks, {args.seq} tokens, {args.layers} checkpointed blocks, "
            f"median of {args.steps} interleaved steps, torch {torch.__version__}\n\n"
            + tabulate(rows, headers="keys", tablefmt="github", floatfmt=".3f"))
    emit(text, args.out)


if __name__ == "__main__":
    main()
