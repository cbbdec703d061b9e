"""Peak memory of the UPipe attention op vs Ulysses at real scale, measured on fake tensors.

    python benchmarks/op_memory.py                 # P=8, 1M tokens, bf16, head_dim 128
    python benchmarks/op_memory.py --json          # machine-readable, for tests

One rank's peak over forward + backward beyond the op's own inputs and outputs (see
upipe_compile.measure.memory), for U = P, 2P and U = all query heads (= Ulysses), with the
analytic ratio (upipe_compile.measure.memory.expected_ratio) beside the measured one. U = P is also
measured with each prefetch mode (the default, "forward", is what every other row uses).
The CUDA kernel's backward workspace is counted (``--cuda-kernel``, default flash-attn:
its fp32 dq accumulator and, for GQA, expanded dK/dV), which the CPU kernels do not allocate.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script: make `benchmarks` importable
    sys.path.append(ROOT)  # after site-packages: an installed upipe_compile wins over the bare checkout

import torch  # noqa: E402
from tabulate import tabulate  # noqa: E402

from benchmarks.report import emit  # noqa: E402
from upipe_compile.attention.kernels import CUDA_KERNELS, DEFAULT_CUDA_KERNEL  # noqa: E402
from upipe_compile.measure.memory import expected_ratio, fake_process_group, measure_op_memory  # noqa: E402

PRESETS = {
    "MHA 64q/64kv": (64, 64),
    "Qwen3-32B 64q/8kv": (64, 8),
    "Llama3-8B 32q/8kv": (32, 8),
}


def run(world: int, seq: int, head_dim: int, cuda_kernel: str | None = DEFAULT_CUDA_KERNEL):
    rows = []
    with fake_process_group(world) as group:
        for name, (q_heads, kv_heads) in PRESETS.items():
            measure = lambda u, prefetch="forward": measure_op_memory(  # noqa: E731
                group, seq=seq, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                heads_per_stage=u, dtype=torch.bfloat16, prefetch=prefetch, cuda_kernel=cuda_kernel,
            )
            ulysses = measure(q_heads)
            configs = [(u, "forward") for u in sorted({world, 2 * world, q_heads})]
            configs[1:1] = [(world, "none"), (world, "both")]
            for u, prefetch in configs:
                result = ulysses if u == q_heads else measure(u, prefetch)
                rows.append({
                    "model": name, "method": "Ulysses" if u == q_heads else "UPipe", "U": u,
                    "prefetch": "(1 stage)" if u == q_heads else prefetch,
                    "fwd_GiB": result.forward_bytes / 2**30, "bwd_GiB": result.backward_bytes / 2**30,
                    "peak_GiB": result.peak_bytes / 2**30,
                    "ratio": result.peak_bytes / ulysses.peak_bytes,
                    "expected": expected_ratio(q_heads, kv_heads, world, u),
                })
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2**20)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--cuda-kernel", default=DEFAULT_CUDA_KERNEL, choices=[*CUDA_KERNELS, "none"],
                        help="whose backward workspace to count (none: only what the CPU kernels allocate)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args(argv)
    cuda_kernel = None if args.cuda_kernel == "none" else args.cuda_kernel
    rows = run(args.world, args.seq, args.head_dim, cuda_kernel)
    if args.json:
        json.dump(rows, sys.stdout)
        return
    text = "\n".join([
        f"# python benchmarks/op_memory.py --world {args.world} --seq {args.seq} --head-dim {args.head_dim} "
        f"--cuda-kernel {args.cuda_kernel}",
        f"# attention op peak beyond its inputs/outputs, per rank, fwd+bwd, bf16, batch 1, P={args.world}, "
        f"{args.seq} tokens (fake tensors + fake process group); CUDA kernel workspace: {args.cuda_kernel}",
        tabulate(rows, headers="keys", floatfmt=".3f", tablefmt="github"),
    ])
    emit(text, args.out)


if __name__ == "__main__":
    main()
