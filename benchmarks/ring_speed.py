"""Speed of ring x all-to-all against pure UPipe on the same ranks (CPU, gloo).

    python benchmarks/ring_speed.py [--world 4] [--seq 16384] [--steps 5] [--out FILE]

Forward + backward of ``upipe_attention`` (causal, fp32, Llama-style GQA heads: 8 q, 2 kv,
head_dim 64) on P real gloo ranks, once over a 1-D mesh (pure UPipe, U = P) and once over a
("cp_ring", "cp_a2a") mesh of R x A = P (U = A), each on its own layout's shards. The
methods alternate step by step (interleaved); each step's time is the slowest rank's, and
the table reports the median. "ring wait" is the time the ring spends waiting for its K/V
and dK/dV send/receive to land (each runs on gloo's threads under the chunk pairs before it:
this is the part the kernels did not hide), the rest is the all-to-alls and kernels. On CPU every rank shares two cores, so the ratio says what the extra chunk pairs
and exchanges cost, not what InfiniBand would.
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

Q_HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64


def _step(ring: int, seq: int, steps: int) -> list[tuple[float, float]]:
    """On every rank: ``steps`` timed forward + backward steps, (seconds, seconds waiting for ring exchanges)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import upipe_compile
    from upipe_compile.attention import ring as ring_module

    world = dist.get_world_size()
    if ring == 1:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        units = world
    else:
        mesh = init_device_mesh("cpu", (ring, world // ring), mesh_dim_names=("cp_ring", "cp_a2a"))
        units = world // ring
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(1, h, seq, HEAD_DIM, generator=gen) for h in (Q_HEADS, KV_HEADS, KV_HEADS, Q_HEADS)]
    q, k, v, dout = (upipe_compile.shard_sequence(t, mesh, dim=2).clone() for t in full)
    exchange = [0.0]
    original = ring_module._Exchange.finish

    def timed_finish(self):
        start = time.perf_counter()
        received = original(self)
        exchange[0] += time.perf_counter() - start
        return received

    ring_module._Exchange.finish = timed_finish
    try:
        results = []
        for _ in range(steps):
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            exchange[0] = 0.0
            dist.barrier()
            start = time.perf_counter()
            out = upipe_compile.upipe_attention(*leaves, is_causal=True, enable_gqa=True, cp_mesh=mesh,
                                                heads_per_stage=units)
            out.backward(dout)
            results.append((time.perf_counter() - start, exchange[0]))
        return results
    finally:
        ring_module._Exchange.finish = original


def run(world: int, seq: int, steps: int, rings: list[int]) -> list[dict]:
    times: dict[int, list[tuple[float, float]]] = {r: [] for r in rings}
    with RankPool(world, threads=1, timeout_s=1800) as pool:
        for ring in rings:
            pool.run(_step, ring, seq, 1)  # warm-up
        for _ in range(steps):  # interleaved: each layout once per round
            for ring in rings:
                per_rank = pool.run(_step, ring, seq, 1)
                times[ring].append(max((r[0] for r in per_rank), key=lambda t: t[0]))
    base = statistics.median(t for t, _ in times[1])
    rows = []
    for ring in rings:
        total = statistics.median(t for t, _ in times[ring])
        rows.append({
            "layout": "UPipe (1-D)" if ring == 1 else f"ring {ring} x all-to-all {world // ring}",
            "U": world if ring == 1 else world // ring, "step_ms": 1e3 * total,
            "ring wait_ms": 1e3 * statistics.median(e for _, e in times[ring]), "vs UPipe": total / base,
        })
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--seq", type=int, default=16384, help="full sequence length")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", help="also write the table to this markdown file")
    args = parser.parse_args(argv)
    rings = [1] + [r for r in (2, 4) if args.world % r == 0 and r < args.world]
    rows = run(args.world, args.seq, args.steps, rings)
    command = "python benchmarks/ring_speed.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = (f"# command: {command.strip()}\n# P={args.world} gloo ranks on CPU, {args.seq} tokens, causal, fp32, "
            f"{Q_HEADS} q / {KV_HEADS} kv heads, head_dim {HEAD_DIM}; median of {args.steps} interleaved steps\n\n"
            + tabulate(rows, headers="keys", floatfmt=".3g", tablefmt="github"))
    emit(text, args.out)


if __name__ == "__main__":
    main()
