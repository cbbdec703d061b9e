"""Memory of the fused attention block against the plain UPipe layer and Ulysses.

    python benchmarks/fused_memory.py [--world 8] [--seq 1048576] [--json]

One rank's forward + backward of an attention layer (projections, RoPE, attention, output
projection; bf16, head_dim 128) on fake tensors over a fake process group, as
``benchmarks/memory.py`` measures it: Ulysses (U = Hq), UPipe (U = P) with the projections
outside the stage loop, and the fused block (``upipe_attention_block``, U = P), where each
stage projects and rotates only its own heads, also with ``recompute_attention_output``
(no attention output kept for backward; each stage's attention forward runs again there).
The flash-attn backward workspace is counted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from tabulate import tabulate

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.memory import PRESETS, measure_layer, upipe  # noqa: E402
from upipe_compile.attention.kernels import DEFAULT_CUDA_KERNEL  # noqa: E402
from upipe_compile.measure.memory import fake_process_group  # noqa: E402


def run(world: int, seq: int) -> list[dict]:
    rows = []
    with fake_process_group(world) as group:
        for preset in PRESETS:
            ulysses = measure_layer(preset, seq, world, upipe(preset.q_heads, group), DEFAULT_CUDA_KERNEL)
            plain = measure_layer(preset, seq, world, upipe(world, group), DEFAULT_CUDA_KERNEL)
            fused = measure_layer(preset, seq, world, ("fused", group, world), DEFAULT_CUDA_KERNEL)
            lean = measure_layer(preset, seq, world, ("fused", group, world, True), DEFAULT_CUDA_KERNEL)
            rows.append({
                "preset": preset.name, "Hq / Hkv": f"{preset.q_heads} / {preset.kv_heads}",
                "Ulysses GiB": ulysses / 2**30, "UPipe GiB": plain / 2**30, "UPipe fused GiB": fused / 2**30,
                "fused, output recomputed GiB": lean / 2**30,
                "UPipe / Ulysses": plain / ulysses, "fused / Ulysses": fused / ulysses,
                "fused, output recomputed / Ulysses": lean / ulysses,
            })
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2**20)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON (for tests)")
    args = parser.parse_args(argv)
    rows = run(args.world, args.seq)
    print(json.dumps(rows) if args.json else tabulate(rows, headers="keys", floatfmt=".3f", tablefmt="github"))


if __name__ == "__main__":
    main()
