"""The policy update of a GRPO step on long rollouts, with and without UPipe context parallelism:
the peak per GPU by the whole-step estimate of the Trainer path (``--hf``), Qwen3-8B on one
8xH100 node, one prompt + completion sequence a micro-batch.

    python benchmarks/grpo_memory.py     # writes benchmarks/results/grpo_memory.md

GRPO's policy update is a training step over prompt + completion scored through TRL's fused LM
head (log-probabilities in token chunks, never the whole logits), which the estimate runs as the
chunked loss (``--loss-chunk-tokens 4096``), with gradient checkpointing and FSDP2 over the 8 GPUs:
UPipeGRPOTrainer shards the sequence over P = 8 ranks (``--cp 8``, U = 8); the stock
GRPOTrainer holds it whole on every rank (``--cp 1 --nodes 8``: 8 data-parallel ranks, FSDP2 over
all). Generation (the KV cache) and the reference model's no-grad forward are not in these peaks.
UPipeGRPOTrainer runs under DDP today (ParallelismConfig is refused), where every GPU holds the
whole fp32 model, its gradients and AdamW's state (16 bytes a parameter: 122 GiB for Qwen3-8B):
these FSDP2 peaks are what it will need once it takes ParallelismConfig(cp_size=P), as
UPipeTrainer does, and what the stock trainer needs today.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from tabulate import tabulate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results", "grpo_memory.md")
LENGTHS = (65_536, 131_072)
JOBS = {  # name: the estimate's layout flags
    "UPipeGRPOTrainer, P = 8 (U = 8)": ["--cp", "8"],
    "GRPOTrainer, no context parallelism": ["--cp", "1", "--nodes", "8"],
}


def command(seq_len: int, layout: list[str]) -> list[str]:
    return ["python", "-m", "upipe_compile.estimate", "--hf", "qwen3-8b", "--seq-len", str(seq_len), *layout,
            "--loss-chunk-tokens", "4096", "--json"]


def main() -> int:
    rows, commands = [], []
    for seq_len in LENGTHS:
        for name, layout in JOBS.items():
            cmd = command(seq_len, layout)
            start = time.time()
            done = subprocess.run([sys.executable, *cmd[1:]], cwd=ROOT, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
            r = json.loads(done.stdout)
            rows.append({"tokens a sequence": f"{seq_len:,}", "trainer": name,
                         "peak GiB": f"{r['peak_device_gib']:.2f}", "device ratio": f"{r['device_ratio']:g}",
                         "expected on device GiB": f"{r['expected_device_peak_gib']:.2f}",
                         "fits 80 GB": "yes" if r["fits_device"] else "NO", "peak in": r["peak_phase"],
                         "wall s": round(time.time() - start)})
            commands.append(" ".join(cmd))
            print(rows[-1], file=sys.stderr, flush=True)
    table = tabulate(rows, headers="keys", tablefmt="github")
    print(table)
    with open(RESULTS, "w") as f:
        f.write("# GRPO's policy update at long context: UPipe against no context parallelism\n\n"
                + __doc__.split("\n\n")[2].replace("``", "`").strip() + "\n\n"
                "`python benchmarks/grpo_memory.py` (2-core CPU, fake tensors; the estimate's budget on an "
                "80 GB H100 is 72.95 GiB with its reserve; \"device ratio\" as in docs/estimate.md).\n\n"
                + table + "\n\nCommands:\n\n```\n" + "\n".join(commands) + "\n```\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
