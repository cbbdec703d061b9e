"""Memory of a sliding-window attention layer against a dense one, UPipe against Ulysses.

    python benchmarks/window_memory.py [--world 8] [--seq 1048576] [--window 4096] [--json]

One rank's forward + backward of an attention layer (projections, RoPE, attention, output
projection; bf16, head_dim 128) on fake tensors over a fake process group, as
``benchmarks/fused_memory.py`` measures it, once dense (causal) and once with a causal
sliding window of ``--window`` tokens (``window=(W - 1, 0)``, Mistral's ``sliding_window=W``):
Ulysses (U = Hq), UPipe (U = P, plain op) and the fused block (U = P). Each stage still holds
its heads over the full sequence, and flash-attn's backward workspace (counted here) does
not shrink with a window, so the windowed rows should equal the dense ones and the UPipe /
Ulysses ratios should be the same.
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


def run(world: int, seq: int, window_tokens: int, presets=PRESETS) -> list[dict]:
    rows = []
    with fake_process_group(world) as group:
        for preset in presets:
            for label, window in (("dense", (-1, -1)), (f"window {window_tokens}", (window_tokens - 1, 0))):
                ulysses = measure_layer(preset, seq, world, upipe(preset.q_heads, group, window), DEFAULT_CUDA_KERNEL)
                plain = measure_layer(preset, seq, world, upipe(world, group, window), DEFAULT_CUDA_KERNEL)
                fused = measure_layer(preset, seq, world, ("fused", group, world, False, window), DEFAULT_CUDA_KERNEL)
                rows.append({
                    "preset": preset.name, "attention": label,
                    "Ulysses GiB": ulysses / 2**30, "UPipe GiB": plain / 2**30, "UPipe fused GiB": fused / 2**30,
                    "UPipe / Ulysses": plain / ulysses, "fused / Ulysses": fused / ulysses,
                })
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2**20)
    parser.add_argument("--window", type=int, default=4096, help="sliding window in tokens (Mistral's sliding_window)")
    parser.add_argument("--presets", nargs="+", choices=[p.name for p in PRESETS],
                        default=[p.name for p in PRESETS])
    parser.add_argument("--json", action="store_true", help="print the rows as JSON (for tests)")
    args = parser.parse_args(argv)
    rows = run(args.world, args.seq, args.window, [p for p in PRESETS if p.name in args.presets])
    print(json.dumps(rows) if args.json else tabulate(rows, headers="keys", floatfmt=".3f", tablefmt="github"))


if __name__ == "__main__":
    main()
