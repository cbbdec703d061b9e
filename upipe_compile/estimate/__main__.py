"""python -m upipe_compile.estimate --config JOB.toml [torchtitan overrides] [--max-context | --plan]
[--gpu-gib G] [--gpus-per-node N] [--host-gib H] [--cuda-kernel K] [--device-ratio R] [--json]

python -m upipe_compile.estimate --hf CONFIG --seq-len N --cp P [--nodes K] [stack flags] [--max-context]
[...the same budget flags] [--json]: a transformers causal LM as UPipeTrainer trains it.

Every argument this command does not know is a torchtitan override (``--training.seq_len
5242880``, ``--upipe.heads_per_stage 32``), parsed by torchtitan's own ConfigManager, which
names any key it does not know. See docs/estimate.md.

Here only the arguments are parsed; the job source the arguments ask for (``--config`` /
``--module``: the torchtitan integration's; ``--hf`` or neither: the transformers one's, which
says what is missing) builds, measures and prints (job_sources.py).
"""

from __future__ import annotations

import argparse
import sys

from upipe_compile.attention.kernels import CUDA_KERNELS, DEFAULT_CUDA_KERNEL
from upipe_compile.errors import UnsupportedAttention
from upipe_compile.estimate.errors import JobError
from upipe_compile.estimate.gpu import DEVICE_RATIO
from upipe_compile.estimate.job_sources import run_source
from upipe_compile.estimate.report import H100_80GB_GIB
from upipe_compile.stack.host_memory import HOST_BUDGET_GIB, HOST_RESERVE_GIB, NODE_2TB_MEMTOTAL_GIB


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m upipe_compile.estimate",
        description="Per-rank peak GPU memory and per-node host memory of one training step of a torchtitan "
                    "job, estimated on fake tensors. Unknown arguments are torchtitan overrides "
                    "(--section.key value).",
    )
    parser.add_argument("--config",
                        help="the job TOML (torchtitan 0.2.2), or with --module the config function (0.3)")
    hf = parser.add_argument_group("transformers models (--hf; instead of --config)")
    hf.add_argument("--hf", metavar="CONFIG",
                    help="a config.json, a model folder, or a shipped config's name: the job is UPipeTrainer's")
    hf.add_argument("--seq-len", type=int, help="tokens of the one row a step trains on")
    hf.add_argument("--cp", type=int, help="P, the context-parallel ranks sharing the row")
    hf.add_argument("--nodes", type=int, default=1,
                    help="K data-parallel groups of P ranks (FSDP over all P x K); default 1")
    hf.add_argument("--ring-degree", type=int, default=1,
                    help="R: the P ranks as a ring of R all-to-all groups of P / R (UPipeTrainer's ring_degree; "
                         "default 1, no ring)")
    hf.add_argument("--heads-per-stage", type=int, help="U, a multiple of P / R (default P / R)")
    hf.add_argument("--loss-chunk-tokens", type=int, default=0, help="the chunked loss (0: the model's own loss)")
    hf.add_argument("--mlp-tile-tokens", type=int, default=0, help="the tiled MLP (0: off)")
    hf.add_argument("--offload-block-inputs", action="store_true", help="checkpointed layer inputs to host memory")
    hf.add_argument("--keep-attention", action="store_true", help="the recompute skips attention")
    hf.add_argument("--fsdp-cpu-offload", action="store_true",
                    help="FSDP2 keeps parameters, gradients and optimizer state in host memory "
                         "(TrainingArguments(fsdp=\"full_shard offload\")); torchtitan jobs: --training.enable_cpu_offload")
    hf.add_argument("--no-gradient-checkpointing", action="store_true",
                    help="TrainingArguments(gradient_checkpointing=False) (default: on, non-reentrant)")
    parser.add_argument("--module", help="torchtitan 0.3: the module holding the config function (its "
                                         "config_registry), e.g. upipe_compile.integrations.torchtitan")
    search = parser.add_mutually_exclusive_group()
    search.add_argument("--max-context", action="store_true",
                        help="search the largest seq_len (a multiple of 1024 x CP degree) that fits both the GPU "
                             "and the host budget, and say which bound stopped it")
    search.add_argument("--plan", action="store_true",
                        help="at the job's seq_len, the fastest setting by the step-time model (heads_per_stage, "
                             "ring_degree, keep_attention, offload_block_inputs) that fits both budgets")
    parser.add_argument("--gpu-gib", type=float, default=H100_80GB_GIB,
                        help=f"GPU memory as torch reports it (default {H100_80GB_GIB}: an 80 GB H100)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="ranks per node, for host memory per node")
    parser.add_argument("--host-gib", type=float, default=HOST_BUDGET_GIB,
                        help=f"host memory per node the offloaded activations may take (default {HOST_BUDGET_GIB}: "
                             f"a 2 TB node's {NODE_2TB_MEMTOTAL_GIB} GiB MemTotal less a {HOST_RESERVE_GIB} GiB reserve "
                             "for the OS, the trainer processes, the dataloader and CUDA/NCCL host buffers)")
    parser.add_argument("--cuda-kernel", choices=sorted(CUDA_KERNELS), default=DEFAULT_CUDA_KERNEL,
                        help=f"the CUDA attention kernel whose backward workspace is counted (default "
                             f"{DEFAULT_CUDA_KERNEL}; the others where it is not installed)")
    parser.add_argument("--device-ratio", type=float, default=DEVICE_RATIO,
                        help=f"a device's peak over the estimate's, for the part above the persistent state (default "
                             f"{DEVICE_RATIO}: measured on an H200, see docs/estimate.md; 1 takes the estimate as the "
                             "device's)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser.parse_known_args(argv)


def main(argv=None) -> int:
    args, unknown = parse_args(sys.argv[1:] if argv is None else argv)
    source = "hf" if args.hf is not None or args.config is None else "torchtitan"
    try:
        return run_source(source, args, unknown)
    except (JobError, UnsupportedAttention) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
