"""The stage-loop op's intermediate memory with packed documents against the unpacked op:
P = 8, 1M tokens, 1000 documents of random lengths (seeded), bf16, head_dim 128, U = P,
measured on fake tensors over a fake process group (the real loops; CUDA kernels'
backward workspaces modelled, see upipe_compile.attention.kernels).

    python benchmarks/packed_memory.py   # writes benchmarks/results/packed_memory.md
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.append(ROOT)  # after site-packages: an installed upipe_compile wins over the bare checkout

import torch  # noqa: E402
from tabulate import tabulate  # noqa: E402

from upipe_compile.attention.kernels import DEFAULT_CUDA_KERNEL  # noqa: E402
from upipe_compile.measure.memory import fake_process_group, measure_op_memory  # noqa: E402

GiB = 2**30
WORLD, SEQ, DOCUMENTS, HEAD_DIM = 8, 1 << 20, 1000, 128
MODELS = [(8, 8), (32, 8), (64, 64)]
KERNELS = {"CPU kernels": None, DEFAULT_CUDA_KERNEL: DEFAULT_CUDA_KERNEL}


def random_bounds(seq: int, count: int, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(seq - 1, generator=gen)[: count - 1] + 1
    return [0, *sorted(cuts.tolist()), seq]


def main() -> int:
    bounds = random_bounds(SEQ, DOCUMENTS)
    rows = []
    with fake_process_group(WORLD) as group:
        for q_heads, kv_heads in MODELS:
            for label, kernel in KERNELS.items():
                common = dict(seq=SEQ, q_heads=q_heads, kv_heads=kv_heads, head_dim=HEAD_DIM, heads_per_stage=WORLD,
                              cuda_kernel=kernel)
                plain = measure_op_memory(group, **common).peak_bytes
                packed = measure_op_memory(group, cu_seqlens=bounds, **common).peak_bytes
                print(f"{q_heads}/{kv_heads} {label}: {plain / GiB:.3f} -> {packed / GiB:.3f} GiB", flush=True)
                rows.append({"model (q/kv heads)": f"{q_heads}/{kv_heads}", "kernel model": label,
                             "unpacked peak GiB": f"{plain / GiB:.3f}", "packed peak GiB": f"{packed / GiB:.3f}",
                             "change": f"{100 * (packed - plain) / plain:+.2f}%"})
    table = tabulate(rows, headers="keys", tablefmt="github")
    print(table)
    text = ("$ python benchmarks/packed_memory.py\n\n"
            f"P = {WORLD}, {SEQ:,} tokens, {DOCUMENTS} random documents (seed 0), bf16, head_dim {HEAD_DIM}, "
            f"U = P; the op's peak beyond its inputs and outputs (fake tensors, fake process group).\n\n"
            f"{table}\n")
    with open(os.path.join(ROOT, "benchmarks", "results", "packed_memory.md"), "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
