"""python -m upipe_compile.estimate --config JOB.toml [torchtitan overrides] [--max-context | --plan]
[--gpu-gib G] [--gpus-per-node N] [--host-gib H] [--cuda-kernel K] [--device-ratio R] [--json]

python -m upipe_compile.estimate --hf CONFIG --seq-len N --cp P [--nodes K] [stack flags] [--max-context]
[...the same budget flags] [--json]: a transformers causal LM as UPipeTrainer trains it (hf.py).

Every argument this command does not know is a torchtitan override (``--training.seq_len
5242880``, ``--upipe.heads_per_stage 32``), parsed by torchtitan's own ConfigManager, which
names any key it does not know. See docs/estimate.md.
"""

from __future__ import annotations

import argparse
import json
import sys

from upipe_compile.errors import UnsupportedAttention
from upipe_compile.attention.kernels import CUDA_KERNELS, DEFAULT_CUDA_KERNEL
from upipe_compile.estimate import H100_80GB_GIB, Estimate, JobError, estimate, load_job_config
from upipe_compile.estimate.gpu import DEVICE_RATIO, RESERVE_FIXED_GIB, RESERVE_FRACTION
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


def format_report(result: Estimate, hf_job=None) -> str:
    lines = [] if hf_job is None else [hf_job.describe()]
    lines += [
        f"seq_len {result.seq_len:,} tokens on {result.world_size} ranks (CP = {result.cp}"
        + ("" if result.ring_degree == 1 else
           f" = ring {result.ring_degree} x all-to-all {result.cp // result.ring_degree}")
        + f", U = {result.heads_per_stage} heads per stage, {result.cuda_kernel} workspaces), "
        f"estimated in {result.seconds:.0f} s",
        "attention ran as: " + (", ".join(f"{kind} x{n}" for kind, n in result.attention_calls.items())
                                  or "plain SDPA (CP = 1)") + " (forward calls, recompute included)",
        f"per-rank peak device memory  {result.peak_device_gib:8.2f} GiB   (at: {result.peak_phase})",
        f"  on the device, expected    {result.expected_device_peak_gib:8.2f} GiB   (x {result.device_ratio:g} above the "
        "persistent state: the ratio measured on a GPU, docs/estimate.md)",
        f"  reserve                    {result.reserve_gib:8.2f} GiB   "
        f"({RESERVE_FIXED_GIB} GiB CUDA context/NCCL/workspaces + {RESERVE_FRACTION:.0%} of the budget for "
        "allocator fragmentation)",
        f"  budget on a {result.gpu_gib} GiB GPU {result.budget_gib:8.2f} GiB   -> "
        + ("fits" if result.fits_device else
           f"DOES NOT FIT (over by {result.expected_device_peak_gib - result.budget_gib:.2f} GiB)"),
        "at the peak, by kind:",
    ]
    b = result.breakdown
    for key in ("sharded_params", "sharded_grads", "optimizer_state", "fsdp_buffers", "model_buffers", "inputs",
                "activations_and_temps"):
        lines.append(f"  {key.replace('_', ' '):26s} {b[key]:8.2f} GiB")
    lines += [
        "measured terms (GiB):",
        f"  checkpointed inputs left on device after forward  {b['checkpointed_inputs_on_device']:8.2f}",
        f"  logits + loss over the end of forward             {b['loss']:8.2f}",
    ]
    block = result.block_recompute
    if block:
        lines.append(f"  one block's backward (layer {block['layer']}: AC recompute + gradients), peak above its start "
                     f"{block['peak_above_start']:.2f}, while in:")
        for key in ("attention_stage_loop", "attention", "mlp", "rest"):
            if key in block:
                lines.append(f"    {key.replace('_', ' '):28s} {block[key]:8.2f}")
        if "stage_loop_backward_buffers" in block:
            lines.append(f"    (the stage loops' own buffers: forward (recompute) {block.get('stage_loop_forward_buffers', 0):.2f}, "
                         f"backward {block['stage_loop_backward_buffers']:.2f})")
    lines.append("device peak within each phase (GiB): "
                 + ", ".join(f"{name} {peak:.2f}" for name, peak in result.phase_peaks.items()))
    for key, value in result.modelled.items():
        lines.append(f"modelled, added to the peak: {key.replace('_', ' ')} {value:.2f} GiB")
    for key, value in result.modelled_host.items():
        lines.append(f"modelled, added to host memory: {key.replace('_', ' ')} {value:.2f} GiB per rank")
    lines.append(f"host memory (offloaded activations): {result.host_gib_per_rank:.2f} GiB per rank, "
                 f"{result.host_gib_per_node:.2f} GiB per node")
    lines.append(f"  host budget per node       {result.host_budget_gib_per_node:8.2f} GiB   -> "
                 + ("fits" if result.fits_host else
                    f"DOES NOT FIT (over by {result.host_gib_per_node - result.host_budget_gib_per_node:.2f} GiB)"))
    lines.append(format_step_time(result))
    return "\n".join(lines)


def format_step_time(result: Estimate) -> str:
    model = result.step_time
    methods = model["methods_seconds"]
    phases = ", ".join(f"{k.replace('_', ' ')} {v:.4g}" for k, v in model["phases"].items() if v)
    return (f"step-time model ({model['device']}): {model['seconds']:.4g} s per step, {model['tokens_per_s']:,.0f} "
            f"tokens/s ({phases}); at this context Ulysses {methods['ulysses']:.4g} s, UPipe {methods['upipe']:.4g} s, "
            f"UPipe + keep_attention {methods['upipe_keep']:.4g} s")


def format_plan(found) -> str:
    lines = [f"plan: {' '.join(found.overrides()) or '(the job as given)'}",
             "  " + ", ".join(f"{k} = {v}" for k, v in found.settings.items()),
             f"  modelled step {found.seconds:.4g} s; Ulysses at this context "
             f"{found.result.step_time['methods_seconds']['ulysses']:.4g} s "
             f"({found.result.step_time['methods_seconds']['ulysses'] / found.seconds:.3f}x its throughput)",
             "settings tried, fastest first:"]
    for settings, seconds, outcome in found.tried:
        lines.append(f"  {seconds:10.4g} s  " + ", ".join(f"{k}={v}" for k, v in settings.items()) + f": {outcome}")
    return "\n".join(lines + ["the plan's estimate:", format_report(found.result)])


def main(argv=None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    if args.hf is not None or args.config is None:
        return main_hf(args, overrides)
    if args.module:
        from upipe_compile.estimate.job import load_config_03

        job_config = load_config_03(args.module, args.config, overrides)
    else:
        job_config = load_job_config(args.config, overrides)
    try:
        if args.max_context:
            from upipe_compile.estimate.search import max_context

            found, result, probes, bound = max_context(
                job_config, gpu_gib=args.gpu_gib, gpus_per_node=args.gpus_per_node, host_gib=args.host_gib,
                progress=not args.json, cuda_kernel=args.cuda_kernel, device_ratio=args.device_ratio)
            payload = {**result.as_json(), "max_context": found, "probes": probes, "bound": bound}
            stopped = (f"the {bound} bound stopped it" if bound else "the probes ran out before a longer one failed")
            text = (f"max context: {found:,} tokens fit {args.gpu_gib} GiB of GPU after its reserve and "
                    f"{args.host_gib} GiB of host memory per node; {stopped} ({len(probes)} probes)\n"
                    + format_report(result))
        elif args.plan:
            from dataclasses import asdict

            from upipe_compile.estimate.plan import plan

            found = plan(job_config, gpu_gib=args.gpu_gib, gpus_per_node=args.gpus_per_node, host_gib=args.host_gib,
                         cuda_kernel=args.cuda_kernel, device_ratio=args.device_ratio)
            payload = {"plan": found.settings, "overrides": found.overrides(), "seconds": found.seconds,
                       "tried": found.tried, "estimate": asdict(found.result)}
            text = format_plan(found)
        else:
            result = estimate(job_config, gpu_gib=args.gpu_gib, gpus_per_node=args.gpus_per_node,
                              host_gib=args.host_gib, cuda_kernel=args.cuda_kernel, device_ratio=args.device_ratio)
            payload, text = result.as_json(), format_report(result)
    except (JobError, UnsupportedAttention) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(payload) if args.json else text)
    return 0


def main_hf(args, unknown) -> int:
    """--hf: the estimate of a transformers model trained by UPipeTrainer (hf.py)."""
    from upipe_compile.estimate.hf import HFJob, estimate_hf, max_context_hf

    problems = []
    if args.config is not None or args.module is not None:
        problems.append("--hf and --config/--module are two kinds of job: give one")
    if args.hf is None:
        problems.append("give --config JOB (torchtitan) or --hf CONFIG (transformers)")
    if args.plan:
        problems.append("--plan is for torchtitan jobs (--config)")
    if unknown:
        problems.append(f"unknown arguments {unknown} (torchtitan overrides go with --config)")
    for flag in ("seq_len", "cp"):
        if args.hf is not None and getattr(args, flag) is None:
            problems.append(f"--hf needs --{flag.replace('_', '-')}")
    if problems:
        print("error: " + "; ".join(problems), file=sys.stderr)
        return 2
    job = HFJob(args.hf, seq_len=args.seq_len, cp=args.cp, nodes=args.nodes, ring_degree=args.ring_degree, heads_per_stage=args.heads_per_stage,
                loss_chunk_tokens=args.loss_chunk_tokens, mlp_tile_tokens=args.mlp_tile_tokens,
                offload_block_inputs=args.offload_block_inputs, keep_attention=args.keep_attention,
                gradient_checkpointing=not args.no_gradient_checkpointing)
    budgets = dict(gpu_gib=args.gpu_gib, gpus_per_node=args.gpus_per_node, host_gib=args.host_gib,
                   cuda_kernel=args.cuda_kernel, device_ratio=args.device_ratio)
    try:
        if args.max_context:
            found, result, probes, bound = max_context_hf(job, progress=not args.json, **budgets)
            payload = {**result.as_json(), "max_context": found, "probes": probes, "bound": bound}
            stopped = (f"the {bound} bound stopped it" if bound else "the probes ran out before a longer one failed")
            text = (f"max context: {found:,} tokens fit {args.gpu_gib} GiB of GPU after its reserve and "
                    f"{args.host_gib} GiB of host memory per node; {stopped} ({len(probes)} probes)\n"
                    + format_report(result, job))
        else:
            result = estimate_hf(job, **budgets)
            payload, text = result.as_json(), format_report(result, job)
    except (JobError, UnsupportedAttention) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json.dumps({**payload, "hf": job.as_json()}) if args.json else text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
