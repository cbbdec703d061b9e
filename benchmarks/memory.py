"""Peak activation memory of one attention layer at real scale, per method, on fake tensors.

    python benchmarks/memory.py                      # full grid, a few minutes on 2 cores
    python benchmarks/memory.py --quick --out-dir /tmp/m   # tiny grid (the test uses this)

One rank's peak over forward + backward of an attention layer as Llama writes it
(q/k/v projections, RoPE, attention, output projection), bf16, batch 1, measured by running
the real code on fake tensors over a fake process group under MemTracker. Reported:
activation memory = peak minus the layer's parameters and their gradients. Methods:
Ulysses (U = all query heads), UPipe with U = P, 2P, 4P, and torch's ring context
parallelism (if it can run here; otherwise the reason is printed).

The analytic expectation printed beside each ratio counts, in units of one head over the
local shard (S/P x head_dim): the layer's own tensors alive at the attention backward,
x + 4*Hq + 4*Hkv (x, q, k, v, out, dout, dq, dk, dv; x has hidden/head_dim units), plus the
op's stage buffers, P * (4*m + 4*k) (backward holds q', out', dout', dq' for m query heads
and k', v', dk', dv' for k KV heads over the full sequence; Ulysses: m = Hq/P, k = Hkv/P),
plus P * 2*k when a KV group spans several stages (its dK/dV then accumulate in fp32).
The measurement also counts the CUDA kernel's backward workspace (``--cuda-kernel``, default
flash-attn: an fp32 dq accumulator and, for GQA, expanded dK/dV), which the CPU kernels run
here do not allocate; the count leaves it out, as it lives only during the kernel.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tabulate import tabulate
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.tiny_llama import rope  # noqa: E402
from upipe_compile.attention.kernels import CUDA_KERNELS, DEFAULT_CUDA_KERNEL  # noqa: E402
from upipe_compile.measure.memory import (  # noqa: E402
    StageLoopFunction, fake_process_group, modelled_kernel, tracker_peak_bytes,
)
from upipe_compile.block.ops import upipe_attention_block  # noqa: E402
from upipe_compile.block.region import BlockRegion  # noqa: E402
from upipe_compile.attention.stage_loop import StageLoopSettings  # noqa: E402
from upipe_compile.attention.schedule import plan_stages  # noqa: E402

HEAD_DIM = 128


@dataclass(frozen=True)
class Preset:
    name: str
    hidden: int
    q_heads: int
    kv_heads: int


PRESETS = [
    Preset("Llama3-8B", 4096, 32, 8),
    Preset("Qwen3-32B", 5120, 64, 8),
    Preset("Llama3-70B", 8192, 64, 8),
    Preset("MHA-64", 8192, 64, 64),
]
K = 1024
SEQS = [128 * K, 256 * K, 512 * K, 1024 * K, 2048 * K, 4096 * K, 8192 * K]


class AttentionLayer(nn.Module):
    def __init__(self, preset: Preset, attention):
        super().__init__()
        self.p, self.attention = preset, attention
        self.wq = nn.Linear(preset.hidden, preset.q_heads * HEAD_DIM, bias=False, dtype=torch.bfloat16)
        self.wk = nn.Linear(preset.hidden, preset.kv_heads * HEAD_DIM, bias=False, dtype=torch.bfloat16)
        self.wv = nn.Linear(preset.hidden, preset.kv_heads * HEAD_DIM, bias=False, dtype=torch.bfloat16)
        self.wo = nn.Linear(preset.q_heads * HEAD_DIM, preset.hidden, bias=False, dtype=torch.bfloat16)

    def forward(self, x, positions):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.p.q_heads, HEAD_DIM).transpose(1, 2)
        k = self.wk(x).view(b, s, self.p.kv_heads, HEAD_DIM).transpose(1, 2)
        v = self.wv(x).view(b, s, self.p.kv_heads, HEAD_DIM).transpose(1, 2)
        q, k = rope(q, positions, 500000.0), rope(k, positions, 500000.0)
        out = self.attention(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FusedAttentionLayer(AttentionLayer):
    """The same layer through the fused block op (``upipe_attention_block``): each stage
    projects, rotates and attends only its own heads and adds its share of ``wo``;
    ``recompute_output``: no attention output kept for backward."""

    def __init__(self, preset: Preset, group, heads_per_stage: int, recompute_output: bool = False,
                 window: tuple[int, int] = (-1, -1)):
        super().__init__(preset, None)
        self.group, self.heads_per_stage, self.recompute_output = group, heads_per_stage, recompute_output

        def rotated(p, n, positions):
            b, s = p.shape[:2]
            return rope(p.view(b, s, n, HEAD_DIM).transpose(1, 2), positions, 500000.0)

        def plain(p, n, positions):
            return p.view(p.shape[0], p.shape[1], n, HEAD_DIM).transpose(1, 2)

        self.region = BlockRegion(preset.q_heads, preset.kv_heads, HEAD_DIM, rotated, rotated, plain, True, None,
                                  window=window)

    def forward(self, x, positions):
        return upipe_attention_block(
            x, self.wq.weight, None, self.wk.weight, None, self.wv.weight, None, self.wo.weight, None, [positions],
            self.region, cp_mesh=self.group, heads_per_stage=self.heads_per_stage,
            recompute_attention_output=self.recompute_output, eager=True,
        )


def upipe(heads_per_stage: int, group, window: tuple[int, int] = (-1, -1)):
    settings = StageLoopSettings(True, None, heads_per_stage, group.size(), group.group_name,
                                 window_left=window[0], window_right=window[1])
    return lambda q, k, v: StageLoopFunction.apply(q, k, v, settings)


def measure_layer(preset: Preset, seq: int, world: int, attention, cuda_kernel: str | None) -> float:
    """Activation peak (bytes) of one rank's forward + backward of the layer;
    ``attention``: an attention function, or ``("fused", group, U[, recompute_output[, window]])``
    for the fused block."""
    s_local = seq // world
    with FakeTensorMode(), modelled_kernel(cuda_kernel):
        layer = FusedAttentionLayer(preset, *attention[1:]) if isinstance(attention, tuple) \
            else AttentionLayer(preset, attention)
        x = torch.empty(1, s_local, preset.hidden, dtype=torch.bfloat16, requires_grad=True)
        positions = torch.arange(s_local).unsqueeze(0)
        tracker = MemTracker()
        tracker.track_external(layer, x, positions)
        with tracker:
            out = layer(x, positions)
            out.backward(torch.empty_like(out))
            peak = tracker_peak_bytes(tracker)
        params = sum(p.numel() * p.element_size() for p in layer.parameters())
    return peak - 2 * params  # parameters and their gradients are the same for every method


def expected_units(preset: Preset, world: int, heads_per_stage: int) -> float:
    sched = plan_stages(preset.q_heads, preset.kv_heads, world, heads_per_stage)
    layer = preset.hidden / HEAD_DIM + 4 * preset.q_heads + 4 * preset.kv_heads
    # bf16 dK/dV summed over several stages of a KV group accumulate in fp32: 2k more units.
    fp32_accumulators = 2 * sched.kv_per_rank if sched.stages_per_group > 1 else 0
    return layer + world * (4 * sched.q_per_rank + 4 * sched.kv_per_rank + fp32_accumulators)


def ring_attention_status(world: int) -> str:
    """Try torch's ring context parallelism on fake CPU tensors; the reason it cannot run."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (world,))
    try:
        with FakeTensorMode():
            buffers = [torch.empty(1, 8, 64 * world, HEAD_DIM, dtype=torch.bfloat16) for _ in range(3)]
            with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2]):
                q, k, v = (b.detach().requires_grad_(True) for b in buffers)
                F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    except Exception as error:  # the message is the finding
        first_line = str(error).strip().splitlines()[0]
        return (f"cannot run here: {type(error).__name__}: {first_line} (torch's ring attention has no CPU "
                "kernel strategy, and fake CUDA tensors crash SDPA on a CPU-only build)")
    return "ok"


def method_stage_heads(preset: Preset, world: int) -> dict[str, int]:
    methods = {"Ulysses": preset.q_heads}
    for mult in (1, 2, 4):
        u = mult * world
        if u < preset.q_heads and preset.q_heads % u == 0:
            methods[f"UPipe U={mult}P"] = u
    return methods


def run(worlds, seqs, presets, cuda_kernel, progress=True):
    rows, ring = [], {}
    total = len(worlds) * len(seqs) * len(presets)
    done, start = 0, time.time()
    for world in worlds:
        with fake_process_group(world) as group:
            ring[world] = ring_attention_status(world)
            for preset in presets:
                methods = method_stage_heads(preset, world)
                for seq in seqs:
                    base = None
                    for method, u in methods.items():
                        peak = measure_layer(preset, seq, world, upipe(u, group), cuda_kernel)
                        base = base or peak
                        expected = expected_units(preset, world, u) / expected_units(preset, world, preset.q_heads)
                        rows.append({
                            "preset": preset.name, "P": world, "seq": seq, "method": method, "U": u,
                            "GiB": peak / 2**30, "ratio": peak / base, "expected": expected,
                            "gap": (peak / base) / expected - 1,
                        })
                    done += 1
                    if progress:
                        print(f"\r[{done}/{total}] P={world} {preset.name} {seq} tokens  {time.time() - start:.0f}s",
                              end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    return rows, ring


def write_outputs(rows, ring, out_dir, command, cuda_kernel):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "memory.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    lines = [f"$ {command}", "",
             "Activation peak of one attention layer (projections, RoPE, attention, output projection), "
             "one rank, forward + backward, bf16, batch 1, head_dim 128; fake tensors + fake process group; "
             f"CUDA kernel workspace modelled: {cuda_kernel or 'none (CPU kernels)'}. "
             "ratio = vs Ulysses at the same P and length; expected = analytic count (see benchmarks/memory.py); "
             "gap = ratio / expected - 1.", ""]
    for world, status in ring.items():
        lines.append(f"- torch ring context parallelism, P={world}: {status}")
    for preset in dict.fromkeys(r["preset"] for r in rows):
        table = [
            {"P": r["P"], "seq": f"{r['seq'] // 1024}K", "method": r["method"], "GiB": r["GiB"],
             "ratio": r["ratio"], "expected": r["expected"], "gap": f"{100 * r['gap']:+.0f}%"}
            for r in rows if r["preset"] == preset
        ]
        lines += ["", f"### {preset}", "", tabulate(table, headers="keys", floatfmt=".3f", tablefmt="github")]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "memory.md"), "w") as f:
        f.write(text)
    plot(rows, os.path.join(out_dir, "memory.png"))
    return text


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    presets = list(dict.fromkeys(r["preset"] for r in rows))
    world = max(r["P"] for r in rows if r["P"] <= 8)
    fig, axes = plt.subplots(1, len(presets), figsize=(4.5 * len(presets), 4), squeeze=False)
    for ax, preset in zip(axes[0], presets):
        mine = [r for r in rows if r["preset"] == preset and r["P"] == world]
        for method in dict.fromkeys(r["method"] for r in mine):
            pts = [(r["seq"], r["GiB"]) for r in mine if r["method"] == method]
            ax.plot([p[0] / 2**20 for p in pts], [p[1] for p in pts], marker="o", label=method)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_title(f"{preset}, P={world}")
        ax.set_xlabel("sequence length (M tokens)")
        ax.set_ylabel("attention-layer activation peak per rank (GiB)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--seqs", type=int, nargs="+", default=SEQS)
    parser.add_argument("--presets", nargs="+", default=[p.name for p in PRESETS])
    parser.add_argument("--quick", action="store_true", help="P=4, 128K tokens, two presets")
    parser.add_argument("--cuda-kernel", default=DEFAULT_CUDA_KERNEL, choices=[*CUDA_KERNELS, "none"],
                        help="whose backward workspace to count (none: only what the CPU kernels allocate)")
    parser.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args(argv)
    if args.quick:
        args.worlds, args.seqs, args.presets = [4], [128 * K], ["Llama3-8B", "MHA-64"]
    presets = [p for p in PRESETS if p.name in args.presets]
    cuda_kernel = None if args.cuda_kernel == "none" else args.cuda_kernel
    rows, ring = run(args.worlds, args.seqs, presets, cuda_kernel)
    command = "python benchmarks/memory.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print(write_outputs(rows, ring, args.out_dir, command.strip(), cuda_kernel))


if __name__ == "__main__":
    main()
