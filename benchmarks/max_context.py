"""Max context on 80 GB H100s and 2 TB nodes by the whole-step estimate: per method, with the
whole long-context stack and with each piece removed in turn.

    python benchmarks/max_context.py [--jobs 2] [--only llama3_8b] [--report-only]

Each row is one ``python -m upipe_compile.estimate --config <TOML> ... --max-context --json``
(a search over seq_len that must fit both the GPU and the node's host memory, see
docs/estimate.md), run in its own process and kept as JSON under
``benchmarks/results/max_context/`` (an existing JSON is reused: delete it to rerun; one
from before the host bound is rerun when its host memory per node is over the host budget).
Then it
writes ``benchmarks/results/max_context.md`` (the table, with each row's command) and
``benchmarks/results/max_context.png`` (per-rank peak device memory against seq_len, the
probes of each search, with the budget and the 80 GB lines).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from tabulate import tabulate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(ROOT)  # after site-packages: an installed upipe_compile wins over the bare checkout

from benchmarks.estimate_runs import stale_ratio  # noqa: E402
from upipe_compile.estimate.gpu import DEVICE_RATIO  # noqa: E402
from upipe_compile.estimate.step_time import ModelShape, Setup, step_time  # noqa: E402
from upipe_compile.stack.host_memory import HOST_BUDGET_GIB, HOST_RESERVE_GIB, NODE_2TB_MEMTOTAL_GIB  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results")
RUNS = os.path.join(RESULTS, "max_context")
TOMLS = os.path.join(ROOT, "integrations", "torchtitan")
CODE_VERSION = 3
"""Bumped when a change lowers the step's peak (version 2: the block-input copy back waits
for the block's own backward; a fused block takes no RoPE-table gradient; version 3: each
rank keeps only its own rows of the RoPE table). A row run with an older version is marked
in the table: its max seq_len is a lower bound for today's code."""


@dataclass(frozen=True)
class Model:
    key: str
    name: str
    toml: str
    q_heads: int
    cp: int
    layers: int
    dim: int
    rings: tuple[int, ...] = ()
    """Ring degrees R of the ring x all-to-all rows (UPipe over CP / R ranks, U = CP / R)."""
    overrides: tuple[str, ...] = ()
    """torchtitan overrides of the TOML that make this row's job (e.g. its CP degree)."""
    whole_stack_only: bool = False
    """Only the whole-stack rows (each removed piece is shown by the one-node rows)."""
    shape: ModelShape | None = None
    """For the step-time model's column."""

    def host_bytes_per_token(self) -> int:
        """Offloaded block inputs per token of the sequence, on one node (8 ranks): bf16."""
        return self.layers * self.dim * 2 * min(self.cp, 8) // self.cp


LLAMA3_8B = ModelShape(n_layers=32, dim=4096, q_heads=32, kv_heads=8, head_dim=128, vocab_size=128256,
                       layer_weights=2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
QWEN3_32B = ModelShape(n_layers=64, dim=5120, q_heads=64, kv_heads=8, head_dim=128, vocab_size=151936,
                       layer_weights=2 * 5120 * 8192 + 2 * 5120 * 1024 + 3 * 5120 * 25600)
MODELS = {
    "llama3_8b": Model("llama3_8b", "Llama3-8B, 8 ranks", "llama3_8b_upipe_5m.toml", 32, 8, 32, 4096,
                       shape=LLAMA3_8B),
    "qwen3_32b": Model("qwen3_32b", "Qwen3-32B, 16 ranks", "qwen3_32b_upipe.toml", 64, 16, 64, 5120,
                       shape=QWEN3_32B),
    "llama3_8b_4_nodes": Model("llama3_8b_4_nodes", "Llama3-8B, 32 ranks (4 nodes)", "llama3_8b_upipe_4_nodes.toml",
                               32, 32, 32, 4096, rings=(4,), whole_stack_only=True, shape=LLAMA3_8B),
    "qwen3_32b_4_nodes": Model("qwen3_32b_4_nodes", "Qwen3-32B, 32 ranks (4 nodes)", "qwen3_32b_upipe.toml",
                               64, 32, 64, 5120, rings=(2, 4),
                               overrides=("--parallelism.context_parallel_degree", "32"), whole_stack_only=True,
                               shape=QWEN3_32B),
}

# Each piece of the stack, and the override that removes it from the shipped TOML (which has all on).
VARIANTS = {
    "whole stack": [],
    "no block-input offload": ["--upipe.no-offload_block_inputs"],
    "no tiled MLP": ["--upipe.mlp_tile_tokens", "0"],
    "no chunked loss": ["--upipe.loss_chunk_tokens", "0"],
    "no fused block": ["--upipe.no-fuse_projections"],
    "+ recomputed attention output": ["--upipe.recompute_attention_output"],
    "+ keep_attention": ["--upipe.keep_attention"],
}
ADDITIONS = {"+ recomputed attention output", "+ keep_attention"}
"""Opt-in keys beyond the shipped stack (rows for UPipe U = P only)."""


def methods(model: Model) -> dict[str, tuple[int, int]]:
    """Method name -> (U, ring degree R). Without a ring U = CP is Ulysses where CP is the
    head count (then one row)."""
    found = {"Ulysses": (model.q_heads, 1)}
    if model.cp < model.q_heads:
        found["UPipe U = P"] = (model.cp, 1)
    if not model.rings:
        found["UPipe U = 2P"] = (2 * model.cp, 1)
    for ring in model.rings:
        found[f"UPipe {model.cp // ring} x ring {ring}"] = (model.cp // ring, ring)
    return found


def method_name(model: Model, method: str) -> str:
    if method == "Ulysses" and model.cp == model.q_heads:
        return "Ulysses = UPipe U = P"
    return method


def rows(only: list[str] | None, whole_stack_only: bool = False) -> list[tuple[Model, str, int, str]]:
    """(model, method, U, variant): the whole stack for every method, each piece removed for
    Ulysses and U = P (U = 2P sits between them), each addition for U = P."""
    out = []
    for model in MODELS.values():
        if only and model.key not in only:
            continue
        for method, (u, _) in methods(model).items():
            for variant in VARIANTS:
                if variant in ADDITIONS:
                    wanted = method == "UPipe U = P" and not (whole_stack_only or model.whole_stack_only)
                else:
                    wanted = variant == "whole stack" or (
                        method in ("Ulysses", "UPipe U = P") and not (whole_stack_only or model.whole_stack_only))
                if wanted:
                    out.append((model, method, u, variant))
    return out


def ring_of(model: Model, u: int) -> int:
    return next(ring for u_, ring in methods(model).values() if u_ == u)


def command(model: Model, u: int, variant: str) -> list[str]:
    ring = ring_of(model, u)
    return ["python", "-m", "upipe_compile.estimate", "--config", f"integrations/torchtitan/{model.toml}",
            *model.overrides, "--upipe.heads_per_stage", str(u),
            *(["--upipe.ring_degree", str(ring)] if model.rings else []), *VARIANTS[variant], "--max-context", "--json"]


def run_path(model: Model, u: int, variant: str) -> str:
    ring = ring_of(model, u)
    tag = "" if ring == 1 else f"_ring{ring}"
    return os.path.join(RUNS, f"{model.key}_u{u}{tag}_{re.sub('[^A-Za-z0-9]+', '_', variant).strip('_')}.json")


def run(model: Model, u: int, variant: str) -> dict:
    path = run_path(model, u, variant)
    if os.path.exists(path):
        with open(path) as f:
            result = json.load(f)
        if not stale_ratio(result, command(model, u, variant)):  # else searched under an older ratio: again
            if "bound" in result:
                return result
            # Searched before the host bound: the device bound stopped it (the next grid step was
            # probed and broke the device budget), valid as long as its host memory fits.
            if result["host_gib_per_node"] <= HOST_BUDGET_GIB:
                return {**result, "bound": "device"}
    cmd = [sys.executable, *command(model, u, variant)[1:]]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout)
    result["code"] = CODE_VERSION
    os.makedirs(RUNS, exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    return result


def table(results) -> list[dict]:
    out = []
    for (model, method, u, variant), r in results:
        stale = "" if r.get("code", 1) >= CODE_VERSION else " *"
        out.append({
            "model": model.name, "method": f"{method_name(model, method)} ({u})", "stack": variant,
            "max seq_len": f"{r['max_context']:,}{stale}", "device ratio": f"{r.get('device_ratio', 1.0):g}",
            "peak GiB there": f"{r['peak_device_gib']:.2f}",
            "peak in": r["peak_phase"], "host GiB per node": f"{r['host_gib_per_node']:.0f}",
            "bound": r["bound"] or "probes spent", "probes": len(r["probes"]),
            "H100 tokens/s there (model)": f"{modelled_tokens_per_s(model, u, variant, r['max_context']):,.0f}",
        })
    return out


def modelled_tokens_per_s(model: Model, u: int, variant: str, seq_len: int) -> float:
    """The step-time model's tokens per second of the row's job at ``seq_len`` on H100s."""
    flags = VARIANTS[variant]
    setup = Setup(seq_len=seq_len, cp=model.cp, heads_per_stage=u, ring_degree=ring_of(model, u),
                  keep_attention="--upipe.keep_attention" in flags,
                  recompute_attention_output="--upipe.recompute_attention_output" in flags,
                  offload_block_inputs="--upipe.no-offload_block_inputs" not in flags)
    return step_time(model.shape, setup).tokens_per_s(setup)


def plot(results, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({m.key for (m, _, _, variant), _ in results if variant == "whole stack"})
    if not models:  # a --rows run without whole-stack rows: nothing to draw
        return
    columns = min(2, len(models))
    rows_of_plots = -(-len(models) // columns)
    fig, axes = plt.subplots(rows_of_plots, columns, figsize=(6.5 * columns, 4.5 * rows_of_plots), squeeze=False)
    for ax in axes.flat[len(models):]:
        ax.set_visible(False)
    for ax, key in zip(axes.flat, models):
        for (model, method, u, variant), r in results:
            if model.key != key or variant != "whole stack":
                continue
            probes = sorted(r["probes"])
            ax.plot([s / 2**20 for s, _ in probes], [p for _, p in probes], marker="o",
                    label=f"{method_name(model, method)} (U={u})")
            ax.set_title(f"{model.name}, whole stack")
            budget, gpu = r["budget_gib"], r["gpu_gib"]
        ax.axhline(gpu, color="k", linestyle="--", linewidth=1, label=f"80 GB H100 ({gpu} GiB to torch)")
        ax.axhline(budget, color="r", linestyle=":", linewidth=1, label=f"budget after reserve ({budget:.2f} GiB)")
        ax.set_xlabel("seq_len (Mi tokens)")
        ax.set_ylabel("per-rank peak device memory (GiB)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def host_ceiling(results) -> list[str]:
    """What one node can hold at most, whatever the GPU: the offloaded block inputs."""
    llama, qwen = MODELS["llama3_8b"], MODELS["qwen3_32b"]

    def most(model: Model) -> str:
        step = 1024 * model.cp
        return f"{HOST_BUDGET_GIB * 2**30 // model.host_bytes_per_token() // step * step:,}"

    lines = [
        "### What one node can hold at most, and why", "",
        "With block-input offload, full AC keeps one hidden-size activation per token per block,",
        "and the offload moves all of them to pinned host memory: host bytes per node = blocks x",
        "tokens on the node x dim x 2 B (bf16), linear in seq_len, none of it on the GPU. For",
        f"Llama3-8B on one node that is 32 x 4096 x 2 B = {llama.host_bytes_per_token() // 1024} KiB per token, so "
        f"{HOST_BUDGET_GIB:,} GiB hold at most",
        f"{most(llama)} tokens whatever the GPU (Qwen3-32B, CP = 16 over 2 nodes: 64 x 5120 x 2 B / 2 =",
        f"{qwen.host_bytes_per_token() // 1024} KiB per token per node, at most {most(qwen)}).",
    ]
    for (model, method, u, variant), r in results:
        if r.get("bound") == "host":
            left = r["budget_gib"] - r.get("expected_device_peak_gib", r["peak_device_gib"])
            block = r["host_gib_per_rank"] / model.layers  # one block's offloaded tensors
            head = (f"{model.name.split(',')[0]}, {method} ({u}), {variant}: the host stops it at "
                    f"{r['max_context']:,} tokens, where the GPU")
            if left < block:
                lines += [
                    head,
                    f"still has {left:.1f} GiB of its budget left, less than one block's offloaded tensors per rank "
                    f"({block:.1f} GiB): keeping",
                    "one block's tensors on the GPU instead of offloading them cannot lengthen the context there.",
                ]
            else:
                lines += [
                    head,
                    f"still has {left:.1f} GiB of its budget left, {int(left // block)} blocks' offloaded tensors "
                    f"per rank ({block:.1f} GiB each): keeping",
                    "that many on the GPU instead of offloading them would lengthen it (not implemented: the "
                    "offload takes every block).",
                ]
    lines += [
        "What moves the host bound: more nodes (the bytes per node scale with the tokens per node,",
        "so CP over 2 nodes halves them; the device bound stays per rank); fewer bytes per",
        "offloaded activation (fp8 would halve them; not implemented, and the recompute would then",
        "start from a rounded input); keeping some blocks' inputs on the GPU (each kept block moves",
        "1/blocks of the host bytes to the device, seq_len / ranks x dim x 2 B per rank, which pays",
        "only where the device has that much left at the host bound); a node with more RAM",
        "(`--host-gib`).",
    ]
    return lines


def write_report(results) -> str:
    lines = [
        "# Max context on 80 GB H100s and 2 TB nodes (whole-step estimate)", "",
        "`python benchmarks/max_context.py` runs, per row, the estimate's max-context search on the",
        "shipped TOML with the row's overrides (the command column), on fake tensors over a fake",
        "process group (2-core CPU, torch 2.13 CPU). Every shipped TOML has the whole stack on",
        "(block-input offload, tiled MLP at 16K tokens, chunked loss at 4K tokens, fused attention",
        "blocks, full AC); each other row removes one piece, or adds an opt-in key (+). Measured by",
        "the fake-tensor run: every",
        "allocation of the step (FSDP, AC, offload, the stage loops, tiled MLP and loss). Modelled,",
        "not measured: flash-attn's backward workspace (counted from its documented buffers),",
        "RMSNorm and RoPE as fused GPU kernels, and the reserve (2.5 GiB CUDA context / NCCL /",
        "workspaces + 5 % fragmentation) that sets the 72.95 GiB budget on a 79.1 GiB H100.",
        "The host is a budget too: the offloaded block inputs of one node (exact-size pinned",
        "buffers, one per block input, measured through the offloader; per rank x 8 ranks) must fit",
        f"{HOST_BUDGET_GIB:,} GiB, a 2 TB node's {NODE_2TB_MEMTOTAL_GIB:,} GiB MemTotal less a "
        f"{HOST_RESERVE_GIB} GiB reserve for the",
        "OS, the 8 trainer processes, the dataloader and CUDA/NCCL host buffers (the same reserve",
        "as `[upipe] host_memory_reserve_gib`'s default, which the job checks at start). \"bound\"",
        "says which budget the next grid step breaks: device or host.", "",
        "\"device ratio\": what the search applied to the peak above the persistent state before",
        f"it met the budget (docs/estimate.md, \"On the device\"): {DEVICE_RATIO}, the largest ratio measured",
        "on a GPU against the estimate, for the rows searched since it is applied; 1 for the rows",
        "searched before, whose lengths hold only if a device agrees with the estimate (\"peak GiB",
        "there\" is the estimate's own peak in both).", "",
        "The rows on 32 ranks (four 8-GPU nodes, CP = 32, FSDP over all 32) compare three layouts",
        "at the same CP degree: Ulysses (U = all query heads; with Llama3-8B's 32 heads that is also",
        "UPipe U = P), UPipe U = P over all 32 ranks where the heads allow it, and UPipe over A ranks",
        "(a node, or two) x ring attention across R = 32 / A groups (`[upipe] ring_degree = R`,",
        "U = A). Their host memory per node is the node's 8 ranks' share.", "",
        tabulate(table(results), headers="keys", tablefmt="github"), "",
    ]
    if any(r.get("code", 1) < CODE_VERSION for _, r in results):
        lines += ["\\* run by an earlier version of the code, whose peak was higher (every rank held the",
                  "whole sequence's RoPE table: seq_len x 64 x 8 B): a lower bound. Delete its JSON and",
                  "rerun to measure it again.", ""]
    lines += ["Commands (from the repository root):", "", "```"]
    for (model, method, u, variant), _ in results:
        lines.append(" ".join(command(model, u, variant)))
    lines += ["```", "", "![peak memory against seq_len](max_context.png)", "", *host_ceiling(results), ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=2, help="searches run at once (each uses about one core)")
    parser.add_argument("--only", nargs="*", choices=sorted(MODELS), help="only these models")
    parser.add_argument("--whole-stack-only", action="store_true", help="skip the rows that remove a piece")
    parser.add_argument("--report-only", action="store_true", help="only rows whose JSON exists; run nothing")
    parser.add_argument("--rows", help="only rows whose 'model / method / stack' contains this text "
                                       "(e.g. 'recomputed'); the report then lists only those")
    args = parser.parse_args(argv)
    todo = rows(args.only, args.whole_stack_only)
    if args.rows:
        todo = [row for row in todo if args.rows in f"{row[0].name} / {row[1]} ({row[2]}) / {row[3]}"]
    if args.report_only:
        todo = [row for row in todo if os.path.exists(run_path(row[0], row[2], row[3]))]
    with ThreadPoolExecutor(args.jobs) as pool:
        found = list(pool.map(lambda row: run(row[0], row[2], row[3]), todo))
    results = list(zip(todo, found))
    report = write_report(results)
    with open(os.path.join(RESULTS, "max_context.md"), "w") as f:
        f.write(report)
    plot(results, os.path.join(RESULTS, "max_context.png"))
    print(tabulate(table(results), headers="keys", tablefmt="github"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
