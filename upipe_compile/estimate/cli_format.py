"""The estimate's text output, shared by every job source's command: the report of one
Estimate, the step-time line, and the max-context search's answer.
"""

from __future__ import annotations

from upipe_compile.estimate.gpu import RESERVE_FIXED_GIB, RESERVE_FRACTION
from upipe_compile.estimate.report import Estimate


def format_report(result: Estimate, job=None) -> str:
    """The report as text; ``job``: what ran, when it describes itself (``job.describe()``, a
    line above the report: the transformers source's HFJob)."""
    lines = [] if job is None else [job.describe()]
    lines += [
        f"seq_len {result.seq_len:,} tokens on {result.world_size} ranks ("
        + ("" if result.tp == 1 else f"TP = {result.tp}, ") + f"CP = {result.cp}"
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
    state = (f", of it FSDP's offloaded state {result.host_state_gib_per_rank:.2f} per rank"
             if result.host_state_gib_per_rank else "")
    lines.append(f"host memory (offloaded activations{', FSDP state' if state else ''}): "
                 f"{result.host_gib_per_rank:.2f} GiB per rank{state}, {result.host_gib_per_node:.2f} GiB per node")
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


def max_context_output(found: int, result: Estimate, probes: list, bound: str | None, *, gpu_gib: float,
                       host_gib: float, job=None) -> tuple[dict, str]:
    """(the JSON payload, the text) of a max-context search's answer (search.search's four
    values); ``job`` as for :func:`format_report`."""
    payload = {**result.as_json(), "max_context": found, "probes": probes, "bound": bound}
    stopped = f"the {bound} bound stopped it" if bound else "the probes ran out before a longer one failed"
    text = (f"max context: {found:,} tokens fit {gpu_gib} GiB of GPU after its reserve and "
            f"{host_gib} GiB of host memory per node; {stopped} ({len(probes)} probes)\n"
            + format_report(result, job))
    return payload, text
