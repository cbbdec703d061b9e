"""A mixture-of-experts model at its longest context on 1 and 4 nodes of 8 H100s, by the
whole-step estimate's max-context search: UPipe against Ulysses and against TP x ring on the
same GPUs, each beside expert parallelism, through torchtitan 0.3.

    PYTHONPATH=.torchtitan03 python benchmarks/fits_moe.py [--report-only]

The model is Qwen3-30B-A3B (48 layers of 128 experts, 8 a token; 32 query / 4 KV heads),
``qwen3_30b_a3b_upipe``: each layer's attention compiled alone as UPipe's stage-loop op beside
0.3's own MoE layers (so no fused block), FSDP's state in host memory, the checkpointed block
inputs offloaded and each MoE layer's tokens in tiles of 16,384; the same job without those two
("no stack"), and TP x ring, which runs neither beside TP. EP's token exchange is sized as a
balanced router sends it (docs/estimate.md). Each row is one ``python -m upipe_compile.estimate ... --max-context
--json`` in its own process, kept as JSON under ``benchmarks/results/fits_moe/`` (an existing one
is reused: delete it to rerun). Writes ``benchmarks/results/fits_moe.md``. The same model through
transformers with the whole long-context stack is in benchmarks/results/max_context_hf.md.
"""

from __future__ import annotations

import argparse
import os
import sys

from tabulate import tabulate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script: make `benchmarks` importable
    sys.path.append(ROOT)  # after site-packages: an installed upipe_compile wins over the bare checkout

from benchmarks.estimate_runs import kept_estimate  # noqa: E402
from benchmarks.report import emit  # noqa: E402
from benchmarks.fits_70b import MODULE, run_path  # noqa: E402
from upipe_compile.estimate.gpu import DEVICE_RATIO  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results")
RUNS = os.path.join(RESULTS, "fits_moe")
JOB = ("--module", MODULE, "--config", "qwen3_30b_a3b_upipe")
FOUR_NODES = ("--parallelism.context_parallel_degree", "32", "--upipe.ring_degree", "4")
ULYSSES = ("--upipe.heads_per_stage", "32")
NO_STACK = ("--upipe.no_offload_block_inputs", "--upipe.mlp_tile_tokens", "0")
"""The shipped config without its long-context stack (TP runs none of it)."""
TP_4 = ("--parallelism.tensor_parallel_degree", "4", "--upipe.heads_per_stage", "8", *NO_STACK)
"""TP 4 (Qwen3-30B-A3B's 4 KV heads allow no more): 8 query heads and 1 KV head per TP rank,
all 8 at once through the ring."""

# (nodes, method, the estimate's arguments)
ROWS = (
    (1, "UPipe U = 8, EP 8, offload + MoE tiles (shipped config)", JOB),
    (1, "Ulysses (U = 32), EP 8, offload + MoE tiles", (*JOB, *ULYSSES)),
    (1, "UPipe U = 8, EP 8, no stack", (*JOB, *NO_STACK)),
    (1, "TP 4 x ring 2, EP 2", (*JOB, *TP_4, "--parallelism.context_parallel_degree", "2", "--upipe.ring_degree",
                                "2", "--parallelism.expert_parallel_degree", "2")),
    (4, "UPipe 8 x ring 4, EP 8, offload + MoE tiles", (*JOB, *FOUR_NODES)),
    (4, "Ulysses (U = 32) x ring 4, EP 8, offload + MoE tiles", (*JOB, *FOUR_NODES, *ULYSSES)),
    (4, "UPipe 8 x ring 4, EP 8, no stack", (*JOB, *FOUR_NODES, *NO_STACK)),
    (4, "TP 4 x ring 8, EP 8", (*JOB, *TP_4, "--parallelism.context_parallel_degree", "8", "--upipe.ring_degree",
                                "8")),
)


def arguments_of(arguments: tuple[str, ...]) -> list[str]:
    return [*arguments, "--max-context", "--json"]


def row(nodes: int, method: str, arguments: tuple[str, ...], r: dict) -> dict:
    return {
        "GPUs": f"{8 * nodes} ({nodes} node{'s' if nodes > 1 else ''})", "method": method,
        "max seq_len": f"{r['max_context']:,}", "on the device GiB": f"{r['expected_device_peak_gib']:.2f}",
        "budget GiB": f"{r['budget_gib']:.2f}", "host GiB per node": f"{r['host_gib_per_node']:.0f}",
        "peak in": r["peak_phase"], "bound": r["bound"] or "probes ran out",
        "step s (model)": f"{r['step_time']['seconds']:.1f}",
        "command": f"`python -m upipe_compile.estimate {' '.join(arguments_of(arguments))}`",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report-only", action="store_true", help="write the table from the kept JSON only")
    args = parser.parse_args()
    rows = []
    for nodes, method, arguments in ROWS:
        result = kept_estimate(arguments_of(arguments), run_path(arguments, RUNS), ROOT, args.report_only)
        if result is not None:
            rows.append(row(nodes, method, arguments, result))
    text = ("# PYTHONPATH=.torchtitan03 python benchmarks/fits_moe.py\n"
            "# Qwen3-30B-A3B (MoE) on 1 and 4 nodes of 8 H100s: the longest context, by the whole-step "
            "estimate\n\n"
            "Each row is the estimate's `--max-context` search (its command beside it, with "
            "`PYTHONPATH=.torchtitan03`): the longest seq_len whose peak, with the device ratio a GPU measured "
            f"({DEVICE_RATIO}) applied above the persistent state, fits the budget (79.1 GiB of an 80 GB H100 less "
            "the CUDA context, NCCL and fragmentation), with the node's host memory (2 TB less the reserve) "
            "checked. torchtitan 0.3's own MoE layers and expert parallelism, each layer's attention compiled "
            "alone as UPipe's stage-loop op, full AC, FSDP's parameters, gradients and optimizer state in host "
            "memory. \"offload + MoE tiles\": the checkpointed block inputs in host memory and each MoE "
            "layer's tokens in tiles of 16,384, each recomputed on its own (the shipped config); \"no "
            "stack\": without them. TP x ring: 0.3's TP with sequence parallelism inside the node, ring "
            "attention of a TP rank's 8 heads at once across the rest, without the two (they do not run "
            "beside TP). \"step s\": the step-time model's seconds for the row.\n\n"
            + tabulate(rows, headers="keys", tablefmt="github", disable_numparse=True))
    emit(text, os.path.join(RESULTS, "fits_moe.md"))


if __name__ == "__main__":
    main()
