"""Training-step speed under full activation checkpointing: UPipe with and without
keep_attention, our Ulysses and DeepSpeed's Ulysses, measured and as the step-time model
predicts them (CPU, gloo).

    python benchmarks/keep_speed.py [--world 2] [--seq 16384] [--layers 2] [--steps 5] [--out FILE]

A stack of Llama-style decoder blocks (benchmarks/tiny_llama.py: hidden 256, 8 q / 2 kv
heads of 32, causal, fp32), each block under ``torch.utils.checkpoint`` (full AC), on P real
gloo ranks; one step is the forward and backward of the stack on this rank's shard. Ours are
compiled with ``backend="upipe"`` (inner backend aot_eager): Ulysses (U = all heads), UPipe
(U = P), UPipe + ``keep_attention`` (the recompute in backward skips attention). DeepSpeed's
``DistributedAttention`` runs the same blocks eagerly (benchmarks/deepspeed_ulysses.py). The
methods alternate step by step (interleaved); each step's time is the slowest rank's; the
table reports the median and the throughput ratio to our Ulysses.

The "model" column is upipe_compile.estimate.step_time's prediction of the same ratio. Its
device rates are this machine's, measured in the same interleaved rounds without
checkpointing: per method, the stack's forward and backward times and one attention forward
(the op alone, its all-to-alls included). The model then adds what full AC reruns (the
forward; without attention under keep_attention), so the column checks its accounting of
activation checkpointing against the real steps.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch
from tabulate import tabulate

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report import emit  # noqa: E402
from upipe_compile.launch import RankPool  # noqa: E402

BASELINE = "Ulysses, full AC"
# name -> (attention: "ulysses" | "upipe" | "deepspeed", keep attention)
METHODS = {
    BASELINE: ("ulysses", False),
    "UPipe, full AC": ("upipe", False),
    "UPipe + keep_attention": ("upipe", True),
    "DeepSpeed Ulysses, full AC": ("deepspeed", False),
}
KINDS = ("ulysses", "upipe", "deepspeed")
_STEPS: dict = {}  # per rank process: key -> one step, compiled once (each its own graphs)


def _blocks(cfg, layers: int):
    import torch.nn as nn

    from benchmarks.tiny_llama import Block

    torch.manual_seed(0)
    return nn.ModuleList(Block(cfg) for _ in range(layers))


def _stack_fn(kind: str, cfg, layers: int, checkpointed: bool, keep: bool):
    """The stack's forward for ``kind``, compiled for ours, eager for DeepSpeed."""
    import torch.distributed as dist
    import torch.utils.checkpoint as checkpoint

    from upipe_compile.stack.keep_attention import keep_attention

    if kind == "deepspeed":
        from benchmarks import deepspeed_ulysses

        reason = deepspeed_ulysses.init("gloo")
        if reason:
            raise RuntimeError(reason)
        state = _blocks(cfg, layers)
        blocks = [deepspeed_ulysses.deepspeed_block(cfg, dist.group.WORLD, b.state_dict()) for b in state]
    else:
        blocks = _blocks(cfg, layers)
    kwargs = {"use_reentrant": False, **({"context_fn": keep_attention} if keep else {})}

    def stack(x, positions):
        for block in blocks:
            x = checkpoint.checkpoint(block, x, positions, **kwargs) if checkpointed else block(x, positions)
        return x

    if kind == "deepspeed":
        return stack
    all_heads = kind == "ulysses"
    return torch.compile(stack, backend="upipe", options={
        "inner_backend": "aot_eager", "heads_per_stage": cfg.q_heads if all_heads else dist.get_world_size()})


def _inputs(cfg, seq: int):
    import upipe_compile

    gen = torch.Generator().manual_seed(1)
    x, dout = (upipe_compile.shard_sequence(torch.randn(1, seq, cfg.hidden, generator=gen), dim=1) for _ in range(2))
    return x, dout, upipe_compile.global_positions(x.shape[1])


def _build_step(method: str, seq: int, layers: int):
    """One checkpointed step: its seconds."""
    import torch.distributed as dist

    from benchmarks.tiny_llama import LlamaConfig

    kind, keep = METHODS[method]
    cfg = LlamaConfig(layers=layers)
    stack = _stack_fn(kind, cfg, layers, checkpointed=True, keep=keep)
    x, dout, positions = _inputs(cfg, seq)

    def step() -> float:
        leaf = x.detach().requires_grad_()
        dist.barrier()
        start = time.perf_counter()
        stack(leaf, positions).backward(dout)
        return time.perf_counter() - start

    return step


def _build_calibration(kind: str, seq: int, layers: int):
    """The stack without checkpointing: (forward s, backward s, one attention forward s)."""
    import torch.distributed as dist

    import upipe_compile
    from benchmarks.tiny_llama import LlamaConfig

    cfg = LlamaConfig(layers=layers)
    stack = _stack_fn(kind, cfg, layers, checkpointed=False, keep=False)
    x, dout, positions = _inputs(cfg, seq)
    n = x.shape[1]
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, cfg.q_heads, n, cfg.head_dim, generator=gen)
    k, v = (torch.randn(1, cfg.kv_heads, n, cfg.head_dim, generator=gen) for _ in range(2))
    if kind == "deepspeed":
        from benchmarks import deepspeed_ulysses

        ds = deepspeed_ulysses.distributed_attention(dist.group.WORLD)
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        attention = lambda: ds(q, k, v, 0)  # noqa: E731
    else:
        u = cfg.q_heads if kind == "ulysses" else dist.get_world_size()
        attention = lambda: upipe_compile.upipe_attention(q, k, v, is_causal=True, enable_gqa=True,  # noqa: E731
                                                          heads_per_stage=u)

    def step() -> tuple[float, float, float]:
        leaf = x.detach().requires_grad_()
        dist.barrier()
        start = time.perf_counter()
        out = stack(leaf, positions)
        forward = time.perf_counter() - start
        dist.barrier()
        start = time.perf_counter()
        out.backward(dout)
        backward = time.perf_counter() - start
        dist.barrier()
        start = time.perf_counter()
        with torch.no_grad():
            attention()
        return forward, backward, time.perf_counter() - start

    return step


def _run(key: tuple):
    if key not in _STEPS:
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        what, name, seq, layers = key
        _STEPS[key] = (_build_step if what == "step" else _build_calibration)(name, seq, layers)
    return _STEPS[key]()


def _slowest(per_rank: list):
    if isinstance(per_rank[0], tuple):
        return tuple(max(values) for values in zip(*per_rank))
    return max(per_rank)


def measure(world: int, seq: int, layers: int, steps: int) -> tuple[dict, dict]:
    """{method: [step s]}, {kind: [(forward, backward, attention forward) s]}, interleaved."""
    keys = [("step", m, seq, layers) for m in METHODS] + [("calibrate", k, seq, layers) for k in KINDS]
    times: dict = {key: [] for key in keys}
    with RankPool(world, threads=1, timeout_s=3600) as pool:
        for key in keys:  # warm-up: compile, then one run of the compiled step
            pool.run(_run, key)
            pool.run(_run, key)
        for _ in range(steps):  # interleaved: each once per round
            for key in keys:
                times[key].append(_slowest(pool.run(_run, key)))
    return ({m: times["step", m, seq, layers] for m in METHODS},
            {k: times["calibrate", k, seq, layers] for k in KINDS})


def modelled_seconds(kind: str, keep: bool, calibration: list, seq: int, world: int, layers: int) -> float:
    """The step-time model's seconds for a checkpointed step of ``kind``, with device rates from
    this kind's uncheckpointed forward/backward and attention forward (medians)."""
    from dataclasses import replace

    from benchmarks.tiny_llama import LlamaConfig
    from upipe_compile.estimate.step_time import Device, ModelShape, Setup, attention_forward_flops, step_time

    cfg = LlamaConfig(layers=layers)
    forward, backward, attention = (statistics.median(c[i] for c in calibration) for i in range(3))
    shape = ModelShape(n_layers=layers, dim=cfg.hidden, q_heads=cfg.q_heads, kv_heads=cfg.kv_heads,
                       head_dim=cfg.head_dim, vocab_size=0, layer_weights=(
                           cfg.hidden * (cfg.q_heads + 2 * cfg.kv_heads) * cfg.head_dim
                           + cfg.q_heads * cfg.head_dim * cfg.hidden + 3 * cfg.hidden * cfg.ffn))
    setup = Setup(seq_len=seq, cp=world, heads_per_stage=cfg.q_heads, element_bytes=4)
    rest_forward = forward / layers - attention  # per layer: everything but attention
    attention_backward = backward / layers - 2 * rest_forward
    if rest_forward <= 0 or attention_backward <= 0:  # too short a run to tell the phases apart
        return math.nan
    flops = attention_forward_flops(shape, setup)
    n = seq / world
    device = Device(  # the all-to-alls are inside the measured attention times
        name="this CPU", matmul_flops=2 * n * shape.layer_weights / rest_forward,
        attention_forward_flops=flops / attention, attention_backward_flops=2.5 * flops / attention_backward,
        all_to_all_bytes=math.inf, inter_node_bytes=math.inf, collective_latency_s=0.0, host_link_bytes=math.inf,
        host_memory_bytes=math.inf)
    return step_time(shape, replace(setup, keep_attention=keep), device).total


def run(world: int, seq: int, layers: int, steps: int) -> list[dict]:
    times, calibration = measure(world, seq, layers, steps)
    base = statistics.median(times[BASELINE])
    model = {m: modelled_seconds(*METHODS[m], calibration[METHODS[m][0]], seq, world, layers) for m in METHODS}
    rows = []
    for method, samples in times.items():
        measured = base / statistics.median(samples)
        predicted = model[BASELINE] / model[method]
        rows.append({"method": method, "step_s": statistics.median(samples),
                     "throughput vs Ulysses": measured, "model: throughput vs Ulysses": predicted,
                     "model error": predicted / measured - 1})
    for kind in KINDS:
        forward, backward, attention = (statistics.median(c[i] for c in calibration[kind]) for i in range(3))
        rows.append({"method": f"({kind}, no AC: forward {forward:.3f} s, backward {backward:.3f} s, "
                               f"one attention forward {attention:.3f} s)"})
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", help="also write the table to this markdown file")
    args = parser.parse_args(argv)
    rows = run(args.world, args.seq, args.layers, args.steps)
    command = " ".join(["python benchmarks/keep_speed.py", *(argv if argv is not None else sys.argv[1:])])
    text = (f"# {command}\n# P={args.world} gloo ranks, {args.seq} tokens, {args.layers} checkpointed blocks, "
            f"median of {args.steps} interleaved steps, torch {torch.__version__}\n\n"
            + tabulate(rows, headers="keys", tablefmt="github", floatfmt=".3f", missingval=""))
    emit(text, args.out)


if __name__ == "__main__":
    main()
