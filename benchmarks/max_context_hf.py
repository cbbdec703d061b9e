"""Max context of the Trainer path (transformers models as ``UPipeTrainer`` trains them) on 80 GB
H100s and 2 TB nodes, by the whole-step estimate ``--hf``: per method, with the whole long-context
stack and, for UPipe on Llama-3.1-8B, with each piece removed in turn; beside the published
figures users compare with (DeepSpeed ALST, TRL's 1M-token Qwen3-8B example).

    python benchmarks/max_context_hf.py [--jobs 2] [--only llama-3.1-8b] [--report-only]

Each row is one ``python -m upipe_compile.estimate --hf CONFIG --seq-len N --cp P ... --max-context
--json`` (a search over --seq-len that must fit both the GPU and the node's host memory, see
docs/estimate.md, "Hugging Face models (--hf)"), run in its own process and kept as JSON under
``benchmarks/results/max_context_hf/`` (an existing JSON is reused: delete it to rerun). One more
row is a plain estimate at a given length, not a search: Qwen3-8B at 1,048,576 tokens, the length
of TRL's example. Then it writes ``benchmarks/results/max_context_hf.md`` (the tables, with each
row's command).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from tabulate import tabulate

from upipe_compile.estimate.gpu import DEVICE_RATIO
from upipe_compile.stack.host_memory import HOST_BUDGET_GIB, HOST_RESERVE_GIB, NODE_2TB_MEMTOTAL_GIB

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
RUNS = os.path.join(RESULTS, "max_context_hf")

GB = 1e9
GIB = 2**30

STACK = {
    "loss_chunk_tokens": ["--loss-chunk-tokens", "4096"],
    "mlp_tile_tokens": ["--mlp-tile-tokens", "16384"],
    "offload_block_inputs": ["--offload-block-inputs"],
}
"""The whole stack: the trainer's keywords as the estimate's flags (the torchtitan TOMLs' sizes)."""

VARIANTS = {
    "whole stack": (),
    "no block-input offload": ("offload_block_inputs",),
    "no tiled MLP": ("mlp_tile_tokens",),
    "no chunked loss": ("loss_chunk_tokens",),
    "no tiled MLP, FSDP state on host": ("mlp_tile_tokens",),
}
"""Variant -> the pieces of the stack it leaves out."""

ADDED = {"no tiled MLP, FSDP state on host": ["--fsdp-cpu-offload"]}
"""Variant -> what it adds to the stack: FSDP2's CPU offload of parameters, gradients and
optimizer state (``TrainingArguments(fsdp="full_shard offload")``)."""


@dataclass(frozen=True)
class Model:
    key: str
    """The shipped config's name (``--hf``)."""
    name: str
    q_heads: int
    cp: int = 8
    nodes: int = 1
    ring: int = 1
    """R of UPipeTrainer's ``ring_degree``: R all-to-all groups of P / R ranks (one a node)."""

    @property
    def label(self) -> str:
        ranks = self.cp * self.nodes
        return f"{self.name}, {ranks} ranks" + (f" ({ranks // 8} nodes)" if ranks > 8 else "")


MODELS = {
    "llama-3.1-8b": Model("llama-3.1-8b", "Llama-3.1-8B", 32),
    "qwen3-8b": Model("qwen3-8b", "Qwen3-8B", 32),
}
FOUR_NODES = Model("llama-3.1-8b", "Llama-3.1-8B", 32, cp=32, ring=4)
"""Four 8-GPU nodes as one 32-rank context-parallel group (ParallelismConfig(cp_size=32), FSDP2 over
all 32) in a ring of 4 all-to-all groups of 8, one a node (``ring_degree=4``)."""
MOE_FOUR_NODES = Model("qwen3-30b-a3b", "Qwen3-30B-A3B (MoE)", 32, cp=32, ring=4)
"""The same four nodes for a mixture-of-experts model (30.5B parameters, 128 experts, 8 a token):
its experts are not tiled (the stack without the tiled MLP)."""
MOE_ONE_NODE = Model("qwen3-30b-a3b", "Qwen3-30B-A3B (MoE)", 32)
"""The MoE model on one node: its fp32 parameters, gradients and AdamW state alone take 56 GiB a
rank, so FSDP keeps them on the host."""

START = {  # the first probe of each search, by (method, variant[, P]): near the answer saves probes
    ("UPipe", "whole stack"): 4_194_304,
    ("Ulysses", "whole stack"): 2_097_152,
    ("UPipe", "no block-input offload"): 1_048_576,
    ("UPipe", "no tiled MLP"): 2_097_152,
    ("UPipe", "no chunked loss"): 262_144,
    ("UPipe", "whole stack", 32): 16_777_216,
    ("Ulysses", "whole stack", 32): 12_582_912,
    ("accelerate CP", "no tiled MLP"): 1_048_576,
    ("UPipe", "no tiled MLP", 32): 8_388_608,
    ("Ulysses", "no tiled MLP", 32): 4_194_304,
    ("UPipe", "no tiled MLP, FSDP state on host"): 1_048_576,
    ("Ulysses", "no tiled MLP, FSDP state on host"): 1_048_576,
}


@dataclass(frozen=True)
class Row:
    model: Model
    method: str
    """"UPipe" (U = P, the default) or "Ulysses" (U = all query heads)."""
    variant: str
    seq_len: int | None = None
    """None: a max-context search; else a plain estimate at this length."""
    device_ratio: float | None = None
    """None: the estimate's default (gpu.DEVICE_RATIO); 1: the estimate's own peak against the budget."""

    @property
    def heads_per_stage(self) -> int | None:
        return self.model.q_heads if self.method in ("Ulysses", "accelerate CP") else None

    @property
    def ring(self) -> int:
        """accelerate's own context parallelism is a ring over all P ranks (an all-to-all of 1)."""
        return self.model.cp if self.method == "accelerate CP" else self.model.ring

    @property
    def u(self) -> int:
        return self.heads_per_stage or self.model.cp // self.ring

    @property
    def search(self) -> bool:
        return self.seq_len is None

    def command(self) -> list[str]:
        removed = VARIANTS[self.variant]
        stack = [flag for key, flags in STACK.items() if key not in removed for flag in flags]
        stack += ADDED.get(self.variant, [])
        seq_len = self.seq_len or START.get((self.method, self.variant, self.model.cp)) or \
            START[(self.method, self.variant)]
        return ["python", "-m", "upipe_compile.estimate", "--hf", self.model.key, "--seq-len", str(seq_len),
                "--cp", str(self.model.cp), *(["--nodes", str(self.model.nodes)] if self.model.nodes > 1 else []),
                *(["--ring-degree", str(self.ring)] if self.ring > 1 else []),
                *(["--heads-per-stage", str(self.heads_per_stage)] if self.heads_per_stage else []), *stack,
                *(["--device-ratio", f"{self.device_ratio:g}"] if self.device_ratio is not None else []),
                *(["--max-context"] if self.search else []), "--json"]

    def path(self) -> str:
        kind = "max_context" if self.search else f"at_{self.seq_len}"
        variant = re.sub("[^A-Za-z0-9]+", "_", self.variant).strip("_")
        ring = f"_ring{self.ring}" if self.ring > 1 else ""
        ratio = f"_ratio{self.device_ratio:g}" if self.device_ratio is not None else ""
        return os.path.join(RUNS, f"{self.model.key}_cp{self.model.cp}{ring}_u{self.u}_{variant}{ratio}_{kind}.json")

    def describe(self) -> str:
        ratio = "" if self.device_ratio is None else f" / device ratio {self.device_ratio:g}"
        return f"{self.model.label} / {method_name(self)} / {self.variant}{ratio}"


def rows(only: list[str] | None) -> list[Row]:
    """In the order they run (the most wanted first): the whole stack for both models and both
    methods, the plain Qwen3-8B rows at TRL's 1M tokens (UPipe; accelerate's own CP with TRL's
    pieces), each piece removed (UPipe on Llama), accelerate's own CP on Llama, then Llama-3.1-8B on
    four nodes (a ring of 4 nodes), with the device ratio and with the estimate's own peak."""
    out = []
    for model in MODELS.values():
        for method in ("UPipe", "Ulysses"):
            out.append(Row(model, method, "whole stack"))
    out.append(Row(MODELS["qwen3-8b"], "UPipe", "whole stack", seq_len=1_048_576))
    out.append(Row(MODELS["qwen3-8b"], "accelerate CP", "no tiled MLP", seq_len=1_048_576))
    for variant in VARIANTS:
        if variant != "whole stack":
            out.append(Row(MODELS["llama-3.1-8b"], "UPipe", variant))
    out.append(Row(MODELS["llama-3.1-8b"], "accelerate CP", "no tiled MLP"))
    for method in ("UPipe", "Ulysses"):
        out.append(Row(FOUR_NODES, method, "whole stack"))
    out.append(Row(FOUR_NODES, "UPipe", "whole stack", device_ratio=1.0))
    for method in ("UPipe", "Ulysses"):
        out.append(Row(MOE_FOUR_NODES, method, "no tiled MLP"))
    for method in ("UPipe", "Ulysses"):
        out.append(Row(MOE_ONE_NODE, method, "no tiled MLP, FSDP state on host"))
    return [row for row in out if not only or row.model.key in only]


def run(row: Row) -> dict:
    path = row.path()
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    cmd = [sys.executable, *row.command()[1:]]
    start = time.time()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout)
    result["wall_s"] = round(time.time() - start)
    result["command"] = " ".join(row.command())
    os.makedirs(RUNS, exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"done: {row.describe()} in {result['wall_s']} s", file=sys.stderr, flush=True)
    return result


def method_name(row: Row) -> str:
    if row.method == "accelerate CP":
        return f"accelerate CP (ring {row.ring}, all {row.u} heads)"
    ring = f", ring {row.ring} x {row.model.cp // row.ring}" if row.ring > 1 else ""
    if row.method == "UPipe":
        return f"UPipe U = P / R ({row.u}){ring}" if ring else f"UPipe U = P ({row.u})"
    return f"Ulysses ({row.u}){ring}"


def table(results) -> list[dict]:
    out = []
    for row, r in results:
        if not row.search:
            continue
        out.append({
            "model": row.model.label, "method": method_name(row), "stack": row.variant,
            "max seq_len": f"{r['max_context']:,}", "device ratio": f"{r.get('device_ratio', 1.0):g}",
            "peak GiB there": f"{r['peak_device_gib']:.2f}",
            "expected on device GiB": f"{r['expected_device_peak_gib']:.2f}",
            "peak in": r["peak_phase"], "host GiB per node": f"{r['host_gib_per_node']:.0f}",
            "bound": r["bound"] or "probes spent", "probes": len(r["probes"]),
            "wall s": r.get("wall_s", ""),
        })
    return out


def plain_table(results) -> list[dict]:
    out = []
    for row, r in results:
        if row.search:
            continue
        out.append({
            "model": row.model.label, "method": method_name(row), "stack": row.variant,
            "seq_len": f"{r['seq_len']:,}",
            "peak GiB (GB)": f"{r['peak_device_gib']:.2f} ({r['peak_device_gib'] * GIB / GB:.1f})",
            "device ratio": f"{r.get('device_ratio', 1.0):g}",
            "expected on device GiB (GB)":
                f"{r['expected_device_peak_gib']:.2f} ({r['expected_device_peak_gib'] * GIB / GB:.1f})",
            "TRL's example (FSDP2 + accelerate CP)": "56.2 GB per GPU",
            "peak in": r["peak_phase"], "host GiB per node": f"{r['host_gib_per_node']:.0f}",
            "fits": "yes" if r["fits"] else "NO", "wall s": r.get("wall_s", ""),
        })
    return out


PUBLISHED = [
    "Published figures users compare with (text, not measured rows: other software, measured on GPUs,",
    "not the estimate's machine model):",
    "",
    "- DeepSpeed ALST (Arctic Long Sequence Training: Ulysses sequence parallelism + tiled MLP +",
    "  tiled loss + activation-checkpoint offload to the CPU, on transformers models through",
    "  DeepSpeed), Meta's Llama 8B: 500K tokens on one H100, 3.7M on one 8xH100 node, over 15M on",
    "  four nodes. Sources: Bekman et al., \"Arctic Long Sequence Training: Scalable And Efficient",
    "  Training For Multi-Million Token Sequences\", arXiv:2506.13996 (2025), abstract; Snowflake's",
    "  post https://www.snowflake.com/en/engineering-blog/arctic-long-sequence-training-multi-million-token-ai/",
    "- TRL's `sft_qwen3_8b_1m_context` example (`examples/sft_qwen3_8b_1m_context/`, huggingface/trl",
    "  PR #6846): Qwen3-8B SFT at 1,048,576 tokens on one 8xH100 node, accelerate's FSDP2 with its",
    "  context parallelism (`cp_size=8`, torch's ring attention), TRL's chunked NLL loss and FSDP2",
    "  activation-checkpointing offload: 56.2 GB per GPU, 380 s per step. Source: TRL v1.13.0",
    "  release notes (https://github.com/huggingface/trl/releases/tag/v1.13.0), \"Training beyond",
    "  1M tokens\"; the guide https://huggingface.co/docs/trl/long_context_training .",
]


def write_report(results) -> str:
    lines = [
        "# Max context of the Trainer path on 80 GB H100s and 2 TB nodes (whole-step estimate, `--hf`)", "",
        "`python benchmarks/max_context_hf.py` runs, per row, the estimate's max-context search on a",
        "transformers model built as `UPipeTrainer` builds it (`python -m upipe_compile.estimate --hf",
        "CONFIG ... --max-context --json`, the command column below; docs/estimate.md, \"Hugging Face",
        "models (--hf)\"): the shipped config (public hyperparameters) on the meta device with upipe's",
        "attention, the trainer's stack (`hf_stack.apply_stack`), gradient checkpointing on every",
        "decoder layer (non-reentrant), FSDP2 as accelerate prepares it (bf16 mixed precision, fp32",
        "master weights, AdamW), one row of N tokens sharded over P = 8 context-parallel ranks (one",
        "8-GPU node), on fake tensors over a fake process group (2-core CPU, torch 2.13 CPU). Four",
        "nodes are P = 32 (`ParallelismConfig(cp_size=32)`, FSDP2 over all 32) in UPipeTrainer's",
        "`ring_degree=4`: a ring of 4 all-to-all groups of 8 ranks, one a node (`--ring-degree 4`; the",
        "row laid out zigzag over the ring). \"whole stack\" is",
        "`loss_chunk_tokens=4096, mlp_tile_tokens=16384, offload_block_inputs=True` (the torchtitan",
        "TOMLs' sizes); each other row removes one piece. UPipe is U = P (the default `heads_per_stage`),",
        "Ulysses U = all 32 query heads (`--heads-per-stage 32`); with a ring U is counted over the",
        "all-to-all group (P / R). \"accelerate CP\" is accelerate's own context parallelism",
        "(`ParallelismConfig(cp_size=P)` without upipe: torch's ring attention over all P ranks, every",
        "head at once), which TRL's example uses, modelled by the same estimate as a ring of P groups of",
        "one rank (`--ring-degree P --heads-per-stage 32`: the same flash kernel, K/V passed round the",
        "ring; torch's own merge buffers are not upipe's and are not counted) with TRL's pieces",
        "(chunked loss, block-input offload, no tiled MLP). Modelled, not measured: flash-attn's",
        "backward workspace, RMSNorm as the fused GPU kernel, cuBLAS workspaces, and the reserve",
        "(2.5 GiB CUDA context / NCCL / workspaces + 5 % fragmentation) that sets the 72.95 GiB budget",
        "on a 79.1 GiB H100. The host is a budget too: the offloaded block inputs of one node (per",
        f"rank x 8 ranks) must fit {HOST_BUDGET_GIB:,} GiB, a 2 TB node's {NODE_2TB_MEMTOTAL_GIB:,} GiB "
        f"MemTotal less a {HOST_RESERVE_GIB} GiB reserve.",
        "\"bound\" says which budget the next grid step (1024 x P tokens) breaks. \"FSDP state on host\" adds",
        "`--fsdp-cpu-offload` (`TrainingArguments(fsdp=\"full_shard offload\")`): FSDP2 keeps the fp32",
        "parameters, gradients and AdamW state (56.9 GiB a rank for the MoE model on one node) in host",
        "memory, which counts towards the host budget; modelled, not measured (docs/estimate.md).", "",
        "\"device ratio\": what the search applied to the peak above the persistent state before it met",
        "the budget (docs/estimate.md, \"On the device\"): 1.35, the largest ratio measured on a GPU",
        "against the estimate when these rows were searched (measured on torchtitan jobs; this path has",
        f"not been measured on a GPU). The estimate applies {DEVICE_RATIO} since a cuDNN run on an H200; rows",
        "searched at 1.35 are about 3 % longer than a search today would give.",
        "\"peak GiB there\" is the estimate's own peak at the row's length; \"expected on device GiB\" is",
        "that peak with the ratio applied, the number the budget is checked against. The lengths are",
        "the estimate's, not runs on GPUs. One four-node row is searched with ratio 1 (the estimate's",
        "own peak against the budget), to show what the ratio costs there. \"wall s\": the row's",
        "process on 2 shared CPU cores, other work running beside it.", "",
        tabulate(table(results), headers="keys", tablefmt="github"), "",
    ]
    plain = plain_table(results)
    if plain:
        lines += [
            "Plain estimates (not searches) at the length of TRL's example: Qwen3-8B, 1,048,576 tokens,",
            "8 ranks, UPipe with the whole stack, and TRL's own job (accelerate CP with its pieces) on",
            "the same machine model. Each per-rank peak and the peak expected on the device (with the",
            "ratio) beside TRL's published 56.2 GB per GPU, measured on GPUs (GB = 10^9 bytes, as it is",
            "quoted; the estimate's GiB converted in brackets).", "",
            tabulate(plain, headers="keys", tablefmt="github"), "",
        ]
    lines += [*PUBLISHED, ""]
    lines += [
        "Not included:",
        "",
        "- The no-stack job (none of the three pieces; only gradient checkpointing): the \"no chunked",
        "  loss\" row already bounds it from above.",
        "",
    ]
    lines += ["Commands (from the repository root):", "", "```"]
    for row, _ in results:
        lines.append(" ".join(row.command()))
    lines += ["```", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=2, help="estimates run at once (each uses about one core)")
    parser.add_argument("--only", nargs="*", choices=sorted({*MODELS, MOE_FOUR_NODES.key}), help="only these models")
    parser.add_argument("--report-only", action="store_true", help="only rows whose JSON exists; run nothing")
    parser.add_argument("--rows", help="only rows whose 'model / method / stack' contains this text")
    args = parser.parse_args(argv)
    todo = rows(args.only)
    if args.rows:
        todo = [row for row in todo if args.rows in row.describe()]
    if args.report_only:
        todo = [row for row in todo if os.path.exists(row.path())]
    def attempt(row: Row):
        try:
            return run(row)
        except RuntimeError as error:  # one failed row does not lose the others
            print(f"failed: {row.describe()}: {error}", file=sys.stderr, flush=True)
            return None

    with ThreadPoolExecutor(args.jobs) as pool:
        found = list(pool.map(attempt, todo))
    results = [(row, r) for row, r in zip(todo, found) if r is not None]
    with open(os.path.join(RESULTS, "max_context_hf.md"), "w") as f:
        f.write(write_report(results))
    print(tabulate(table(results), headers="keys", tablefmt="github"))
    if plain_table(results):
        print(tabulate(plain_table(results), headers="keys", tablefmt="github"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
