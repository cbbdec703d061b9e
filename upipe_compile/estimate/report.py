"""The estimate's report of a measured step, whatever built the job: the modelled terms added,
the device ratio and both budgets (GPU, host) applied, the peak broken down by kind, by phase
and within the highest block's backward, and the step-time model's view beside it.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace

from upipe_compile.estimate.gpu import GIB, budget_gib, device_peak_gib
from upipe_compile.estimate.step import StepMemory
from upipe_compile.estimate.step_time import H100, ModelShape, Setup, model_flops, step_time, ulysses

H100_80GB_GIB = 79.1
"""What torch reports as the total memory of an "80 GB" H100."""


@dataclass
class Estimate:
    seq_len: int
    cuda_kernel: str
    """The CUDA attention kernel whose backward workspace is counted (one of kernels.CUDA_KERNELS)."""
    world_size: int
    cp: int
    heads_per_stage: int
    """U, counted over the all-to-all ranks (``cp / ring_degree``)."""
    ring_degree: int
    """R of a ring x all-to-all layout ([upipe] ring_degree); 1: no ring."""
    peak_device_gib: float
    """Per-rank device peak of the step (measured on fake tensors + the kernels' workspaces)."""
    device_ratio: float
    """What a device's peak was measured to be over ``peak_device_gib`` for the part above the
    persistent state (gpu.DEVICE_RATIO; 1.0 for a CPU job or when told so)."""
    expected_device_peak_gib: float
    """``peak_device_gib`` with ``device_ratio`` applied (gpu.device_peak_gib): what must fit."""
    reserve_gib: float
    """``gpu_gib - budget_gib``: the fixed reserve + the fragmentation share of a budget-sized peak."""
    gpu_gib: float
    budget_gib: float
    """What the peak must not exceed (gpu.budget_gib)."""
    fits: bool
    """Both bounds: ``fits_device and fits_host``."""
    fits_device: bool
    """The expected device peak does not exceed ``budget_gib``."""
    fits_host: bool
    """What one node's ranks offload (activations, FSDP's state) does not exceed ``host_budget_gib_per_node``."""
    host_gib_per_rank: float
    """Host memory one rank holds at its peak: the offloader's pinned buffers, one exact-size
    buffer per offloaded block input (measured through the offloader on fake tensors), and the
    state FSDP offloads (``host_state_gib_per_rank``)."""
    host_gib_per_node: float
    """``host_gib_per_rank`` x the ranks on one node (min(world size, gpus_per_node))."""
    host_budget_gib_per_node: float
    """What ``host_gib_per_node`` must not exceed (host.HOST_BUDGET_GIB unless given)."""
    peak_phase: str
    breakdown: dict[str, float]
    block_recompute: dict[str, float]
    phase_peaks: dict[str, float]
    """Device peak within each phase of the step: where the next saving must come from."""
    modelled: dict[str, float]
    """Terms added to the measured peak because the fake-tensor run cannot show them (GiB)."""
    modelled_host: dict[str, float]
    """The same for ``host_gib_per_rank``: keep_attention's outputs offloaded beside the block inputs."""
    step_time: dict
    """The step-time model's expected seconds per step on an H100 (step_time.py): this job's
    phases and total, and beside it Ulysses (all heads per stage, plain full AC), UPipe with
    this job's U without keep_attention, and with it, at the same context."""
    attention_calls: dict[str, int]
    """How the step's attention ran, as forward calls of each op's eager twin (AC's
    recompute included): "fused block" (``upipe::attention_block``), "stage-loop op"
    (``upipe::attention``: ``fuse_projections = false`` or a block the pass did not fuse)."""
    seconds: float
    host_state_gib_per_rank: float = 0.0
    """What of ``host_gib_per_rank`` is FSDP's offloaded state (``training.enable_cpu_offload``:
    sharded parameters, gradients, optimizer state and the optimizer step's temporaries); 0
    when the job keeps it on the device."""
    tp: int = 1
    """Tensor-parallel degree beside the CP ranks (``world_size`` = data x TP x CP)."""

    def as_json(self) -> dict:
        return asdict(self)


def result_of(memory: StepMemory, *, seq_len: int, cuda_kernel: str | None, world: int, cp: int,
              heads_per_stage: int, ring_degree: int, modelled: dict, modelled_host: dict, gpu_gib: float,
              gpus_per_node: int, host_gib: float, device_ratio: float, step_time: dict,
              attention_calls: dict, start: float, tp: int = 1) -> Estimate:
    """The report of a measured step, whatever built the job (the torchtitan integration's
    estimate_run.py, the transformers one's hf_estimate.py): the modelled terms added, the device
    ratio and both budgets applied."""
    peak = memory.peak_snapshot.get("Total", 0) / GIB + sum(modelled.values())
    budget = budget_gib(gpu_gib)
    host = (memory.host_peak + memory.host_state_peak) / GIB + sum(modelled_host.values())
    host_per_node = host * min(world, gpus_per_node)
    breakdown = _breakdown(memory)
    expected = device_peak_gib(peak, persistent_gib(breakdown), device_ratio)
    fits_device, fits_host = expected <= budget, host_per_node <= host_gib
    return Estimate(
        seq_len=seq_len, cuda_kernel=cuda_kernel, world_size=world, cp=cp, heads_per_stage=heads_per_stage,
        ring_degree=ring_degree,
        peak_device_gib=round(peak, 6), device_ratio=device_ratio, expected_device_peak_gib=round(expected, 6),
        reserve_gib=round(gpu_gib - budget, 6), gpu_gib=gpu_gib,
        budget_gib=round(budget, 6), fits=fits_device and fits_host, fits_device=fits_device, fits_host=fits_host,
        host_gib_per_rank=round(host, 6), host_gib_per_node=round(host_per_node, 6),
        host_budget_gib_per_node=float(host_gib),
        peak_phase=" ".join(str(p) for p in memory.peak_phase or ()),
        breakdown=breakdown, block_recompute=_block_recompute(memory),
        phase_peaks=_phase_peaks(memory), modelled=modelled, modelled_host=modelled_host,
        step_time=step_time, attention_calls=attention_calls, seconds=round(time.time() - start, 1),
        host_state_gib_per_rank=_gib(memory.host_state_peak), tp=tp,
    )


def step_time_report(shape: ModelShape, setup: Setup) -> dict:
    """The step-time model's view of the job and, at the same context, of the other methods."""
    this = step_time(shape, setup)
    seconds = {
        "ulysses": step_time(shape, ulysses(replace(setup, keep_attention=False), shape)).total,
        "upipe": step_time(shape, replace(setup, keep_attention=False)).total,
        "upipe_keep": step_time(shape, replace(setup, keep_attention=setup.full_ac)).total,
    }
    return {"device": H100.name, "shape": asdict(shape), "seconds": _round(this.total),
            "tokens_per_s": round(this.tokens_per_s(setup), 1), "model_flops": model_flops(shape, setup),
            "phases": {k: _round(v) for k, v in asdict(this).items()},
            "methods_seconds": {k: _round(v) for k, v in seconds.items()}}


def _round(seconds: float) -> float:
    return float(f"{seconds:.4g}")


# FSDPMemTracker's categories, grouped as the report names them.
_CATEGORIES = {
    "sharded_params": ("Sharded Param",),
    "sharded_grads": ("Sharded Grad",),
    "optimizer_state": ("OptState",),
    "fsdp_buffers": ("Unsharded Param", "Unsharded Grad", "All Gather", "Reduce Scatter"),
    "model_buffers": ("Buffer",),
    "inputs": ("Inputs",),
    "activations_and_temps": ("Activation", "Temp"),
}


def _gib(x: int) -> float:
    return round(x / GIB, 6)


PERSISTENT = ("sharded_params", "sharded_grads", "optimizer_state", "model_buffers")
"""The breakdown's kinds the device ratio does not scale (counted exactly)."""


def persistent_gib(breakdown: dict) -> float:
    """What of a peak's breakdown the device ratio leaves as it is (:data:`PERSISTENT`)."""
    return sum(breakdown[k] for k in PERSISTENT)


def with_device_ratio(report: dict, ratio: float) -> dict:
    """A JSON report (:meth:`Estimate.as_json`) as the same step reads under another device
    ratio: the expected peak and the fits follow from the measured peak and persistent state,
    which the ratio leaves as they are (a max-context search's length does not: search again)."""
    expected = device_peak_gib(report["peak_device_gib"], persistent_gib(report["breakdown"]), ratio)
    fits_device = expected <= report["budget_gib"]
    return {**report, "device_ratio": ratio, "expected_device_peak_gib": round(expected, 6),
            "fits_device": fits_device, "fits": fits_device and report["fits_host"]}


def _breakdown(memory: StepMemory) -> dict[str, float]:
    """The device peak by kind (these sum to the peak), then two measured terms inside
    activations: the checkpointed block inputs left on device after forward and what the
    logits and loss add over the end of forward."""
    snap = {str(getattr(k, "value", k)): v for k, v in memory.peak_snapshot.items()}
    out = {name: _gib(sum(snap.get(c, 0) for c in cats)) for name, cats in _CATEGORIES.items()}
    out["checkpointed_inputs_on_device"] = _gib(memory.checkpointed_on_device)
    loss_peak = max((s.peak for p, s in memory.phases.items() if p[0] in ("loss", "loss backward")), default=0)
    out["loss"] = _gib(max(0, loss_peak - (memory.after_forward - memory.logits)))
    return out


def _phase_peaks(memory: StepMemory) -> dict[str, float]:
    peaks: dict[str, int] = {}
    for phase, stats in memory.phases.items():
        if len(phase) == 3:
            name = f"{phase[0]} blocks"
        elif len(phase) == 2:
            name = f"{phase[0]} {phase[1]}"
        else:
            name = phase[0].replace(" backward", "")  # the loss forward and backward together
        if name == "setup":
            continue
        peaks[name] = max(peaks.get(name, 0), stats.peak)
    return {name: _gib(peak) for name, peak in peaks.items()}


def _block_recompute(memory: StepMemory) -> dict[str, float]:
    """The block whose backward (AC recompute + gradients) peaks highest: how far each of its
    parts rises above the memory at the start of that block's backward, and the stage loops'
    own buffers (forward loop in the recompute, backward loop: each above where it starts)."""
    blocks: dict[int, dict[tuple, object]] = {}
    for phase, stats in memory.phases.items():
        if len(phase) == 3 and phase[0] in ("recompute", "backward"):
            blocks.setdefault(phase[1], {})[(phase[0], phase[2])] = stats
    if not blocks:
        return {}
    layer = max(blocks, key=lambda i: max(s.peak for s in blocks[i].values()))
    parts = blocks[layer]
    start = min(s.entry for s in parts.values())
    result = {"layer": layer, "peak_above_start": _gib(max(s.peak for s in parts.values()) - start)}
    # A fused block runs projections, RoPE and stage loop in one op: all "attention".
    names = {"stage loop": "attention_stage_loop", "attention": "attention", "mlp": "mlp", "rest": "rest"}
    for part, name in names.items():
        peaks = [s.peak for (_, p), s in parts.items() if p == part]
        if peaks:
            result[name] = _gib(max(peaks) - start)
    for direction, name in (("recompute", "stage_loop_forward_buffers"), ("backward", "stage_loop_backward_buffers")):
        loop = parts.get((direction, "stage loop"))
        if loop is not None:
            result[name] = _gib(loop.peak - loop.entry)
    return result
