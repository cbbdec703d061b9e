"""Llama-3.1-70B on 4 and 8 nodes of 8 H100s by the whole-step estimate: does a job fit, at a
given length, with UPipe and with Ulysses on the same GPUs and the same ring.

    python benchmarks/fits_70b.py [--report-only]
    (the torchtitan 0.3 rows need torchtitan 0.3 on the path: PYTHONPATH=.torchtitan03)

Each row is one ``python -m upipe_compile.estimate ... --json`` (one step on fake tensors,
the device ratio a GPU measured applied, the node's host budget checked), run in its own
process and kept as JSON under ``benchmarks/results/fits_70b/`` (an existing one is reused:
delete it to rerun; a 70B step takes minutes on a CPU). Writes
``benchmarks/results/fits_70b.md``. UPipe's rows use no tensor parallelism: FSDP shards the
weights over all the GPUs (on four nodes keeping them, their gradients and the optimizer state
in host memory), which keeps the fused blocks and the long-context stack. The TP x ring rows are
the layout Megatron-style jobs use on the same GPUs: torchtitan 0.3's TP 8 inside each node
(sequence parallelism), ring attention of all 8 of a TP rank's heads at once across the nodes
(``upipe.heads_per_stage 8`` over an all-to-all of one rank), FSDP over the CP ranks; the
stack's block-input offload and tiled MLP do not run beside TP, FSDP's own CPU offload does.
Their lengths: the longest the estimate's ``--max-context`` search found (the same arguments
with ``--max-context``; its probes kept under ``benchmarks/results/fits_70b/search/``), and UPipe's.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys

from tabulate import tabulate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script: make `benchmarks` importable
    sys.path.append(ROOT)  # after site-packages: an installed upipe_compile wins over the bare checkout

from benchmarks.estimate_runs import kept_estimate  # noqa: E402
from benchmarks.report import emit  # noqa: E402
from upipe_compile.estimate.gpu import DEVICE_RATIO  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results")
RUNS = os.path.join(RESULTS, "fits_70b")
TOML_8B_4_NODES = "integrations/torchtitan/llama3_8b_upipe_4_nodes.toml"
TOML_70B_8_NODES = "integrations/torchtitan/llama3_70b_upipe_8_nodes.toml"
MODULE = "upipe_compile.integrations.torchtitan"
EIGHT_NODES = ("--parallelism.context_parallel_degree", "64", "--upipe.ring_degree", "8")
STATE_ON_HOST = ("--training.enable_cpu_offload", "--upipe.blocks_kept_on_device", "8", "--upipe.mlp_tile_tokens",
                 "8192", "--upipe.recompute_attention_output")
"""FSDP's parameters, gradients and optimizer state in host memory; the freed GPU memory holds the
last 8 blocks' inputs (the shipped 0.3 four-node config's settings)."""

TP_X_RING = ("--module", MODULE, "--parallelism.tensor_parallel_degree", "8", "--upipe.heads_per_stage", "8",
             "--upipe.no_fuse_projections", "--upipe.no_offload_block_inputs", "--upipe.mlp_tile_tokens", "0")
TP_X_RING_4 = (*TP_X_RING, "--config", "llama3_70b_upipe_4_nodes", "--parallelism.context_parallel_degree", "4",
               "--upipe.ring_degree", "4", "--upipe.blocks_kept_on_device", "0",
               "--upipe.no_recompute_attention_output")
"""TP 8 x ring 4 on the 4-node config's 32 GPUs, FSDP's state on the host as that config keeps it."""
TP_X_RING_8 = (*TP_X_RING, "--config", "llama3_70b_upipe_8_nodes", "--parallelism.context_parallel_degree", "8",
               "--upipe.ring_degree", "8")

# (nodes, method, torchtitan release, the estimate's arguments)
ROWS = (
    (4, "UPipe 8 x ring 4, MLP tiles of 16K", "0.2.2",
     ("--config", TOML_8B_4_NODES, "--model.flavor", "70B", "--training.seq_len", "5242880")),
    (4, "UPipe 8 x ring 4, MLP tiles of 8K", "0.2.2",
     ("--config", TOML_8B_4_NODES, "--model.flavor", "70B", "--training.seq_len", "4718592",
      "--upipe.mlp_tile_tokens", "8192")),
    (4, "UPipe 8 x ring 4, FSDP state on host, last 8 blocks' inputs on GPU (shipped config)", "0.3",
     ("--module", MODULE, "--config", "llama3_70b_upipe_4_nodes")),
    (4, "UPipe 8 x ring 4, FSDP state on host, last 8 blocks' inputs on GPU", "0.2.2",
     ("--config", TOML_8B_4_NODES, "--model.flavor", "70B", "--training.seq_len", "5242880", *STATE_ON_HOST)),
    (4, "Ulysses (U = 64) x ring 4, the same", "0.2.2",
     ("--config", TOML_8B_4_NODES, "--model.flavor", "70B", "--training.seq_len", "5242880", *STATE_ON_HOST,
      "--upipe.heads_per_stage", "64")),
    (8, "UPipe 8 x ring 8", "0.2.2",
     ("--config", TOML_8B_4_NODES, "--model.flavor", "70B", *EIGHT_NODES, "--training.seq_len", "10485760")),
    (8, "UPipe 8 x ring 8 (shipped TOML)", "0.2.2", ("--config", TOML_70B_8_NODES)),
    (8, "Ulysses (U = 64) x ring 8", "0.2.2",
     ("--config", TOML_8B_4_NODES, "--model.flavor", "70B", *EIGHT_NODES, "--training.seq_len", "11010048",
      "--upipe.heads_per_stage", "64")),
    (8, "UPipe 8 x ring 8 (shipped config)", "0.3", ("--module", MODULE, "--config", "llama3_70b_upipe_8_nodes")),
    (4, "TP 8 x ring 4, FSDP state on host (its longest)", "0.3", (*TP_X_RING_4, "--training.seq_len", "724992")),
    (4, "TP 8 x ring 4, FSDP state on host (UPipe's length)", "0.3", (*TP_X_RING_4, "--training.seq_len", "5242880")),
    (8, "TP 8 x ring 8 (its longest)", "0.3", (*TP_X_RING_8, "--training.seq_len", "1204224")),
    (8, "TP 8 x ring 8 (UPipe's length)", "0.3", (*TP_X_RING_8, "--training.seq_len", "11010048")),
)


def command(arguments: tuple[str, ...]) -> list[str]:
    return ["python", "-m", "upipe_compile.estimate", *arguments, "--json"]


def run_path(arguments: tuple[str, ...], runs: str = RUNS) -> str:
    """Where a row's estimate is kept: its arguments as a file name under ``runs``."""
    slug = re.sub("[^A-Za-z0-9]+", "_", " ".join(a.rsplit("/", 1)[-1] for a in arguments)).strip("_")
    if len(slug) > 240:  # a file name's limit is 255 bytes: the long TP rows end in a digest
        slug = f"{slug[:200]}_{hashlib.sha1(slug.encode()).hexdigest()[:12]}"
    return os.path.join(runs, f"{slug}.json")


def run(arguments: tuple[str, ...], report_only: bool) -> dict | None:
    return kept_estimate(command(arguments)[3:], run_path(arguments), ROOT, report_only)


def row(nodes: int, method: str, release: str, arguments: tuple[str, ...], r: dict) -> dict:
    return {
        "GPUs": f"{8 * nodes} ({nodes} nodes)", "method": method, "torchtitan": release,
        "seq_len": f"{r['seq_len']:,}", "fits": "yes" if r["fits"] else "no",
        "estimate GiB": f"{r['peak_device_gib']:.2f}", "on the device GiB": f"{r['expected_device_peak_gib']:.2f}",
        "budget GiB": f"{r['budget_gib']:.2f}",
        "host GiB per node": f"{r['host_gib_per_node']:.0f} of {r['host_budget_gib_per_node']:.0f}",
        "peak in": r["peak_phase"], "command": f"`{' '.join(command(arguments))}`",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report-only", action="store_true", help="write the table from the kept JSON only")
    args = parser.parse_args()
    rows = []
    for nodes, method, release, arguments in ROWS:
        result = run(arguments, args.report_only)
        if result is not None:
            rows.append(row(nodes, method, release, arguments, result))
    text = ("# python benchmarks/fits_70b.py\n"
            "# Llama-3.1-70B on 4 and 8 nodes of 8 H100s: fits at a length, by the whole-step estimate\n\n"
            "Each row's command is beside it (the 0.3 rows with "
            "`PYTHONPATH=.torchtitan03`). \"on the device\": the estimate with the device ratio a GPU "
            f"measured ({DEVICE_RATIO}) applied above the parameters, gradients and optimizer state (where they "
            "are on the GPU); a job fits when that is within the budget (79.1 GiB of an 80 GB H100 less the CUDA "
            "context, NCCL and fragmentation) and what it offloads (block inputs; with \"FSDP state on host\", "
            "`training.enable_cpu_offload`, the parameters, gradients and optimizer state too, modelled) fits the "
            "node's host budget (2 TB less the reserve). FSDP shards the weights over all the GPUs (no tensor "
            "parallelism) but in the TP x ring rows: torchtitan 0.3's TP 8 inside each node, ring attention over "
            "all 8 of a TP rank's heads at once across the nodes, FSDP over the CP ranks, without the block-input "
            "offload and tiled MLP (they do not run beside TP); the longest TP x ring length is the estimate's "
            "`--max-context` search.\n\n"
            + tabulate(rows, headers="keys", tablefmt="github", disable_numparse=True))
    emit(text, os.path.join(RESULTS, "fits_70b.md"))


if __name__ == "__main__":
    main()
