"""One training step of a built job under a memory tracker, whatever built the job (the job
sources hand in their Trainer's step: each torchtitan release's estimate.py, the
transformers one's hf_estimate.py).

``FSDPMemTracker`` counts every tensor the step allocates on each device, by kind (sharded /
unsharded params and grads, FSDP all-gather buffers, optimizer state, activations, temps).
:class:`PhaseTracker` adds where in the step each peak happens: per block and per part of a
block (attention, its stage loop, MLP, the rest) in forward, in activation checkpointing's
recompute and in backward; the loss; the optimizer step. Host memory (offloaded
activations, packed to "meta" while measuring) shows up as its own device. A job whose FSDP
offloads its state to the host (``offloaded_state``) has its sharded parameters, gradients and
optimizer state, and the optimizer step's work, counted on the host instead of the device.
"""

from __future__ import annotations

import re
from collections import defaultdict
from contextlib import ExitStack
from copy import deepcopy
from typing import Callable, ContextManager, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from upipe_compile.estimate.fsdp_param_groups import ParamGroupsTracker, param_groups
from upipe_compile.estimate.plain_loops import cuda_embedding_backward, fused_rms_norm

DEVICE = torch.device("cpu")  # the fake stand-in for the GPU
HOST = torch.device("meta")  # where offloaded activations are packed while measuring
_LAYER = re.compile(r"\.layers\.(\d+)(\.|$)")
OFFLOADED_STATE_KINDS = ("Sharded Param", "Sharded Grad", "OptState")
"""FSDPMemTracker's kinds that FSDP2's CPUOffloadPolicy keeps on the host: the sharded
parameters, their gradients (copied out after each reduce-scatter) and, because the optimizer
steps where its parameters are, the optimizer state."""


def _kind(key) -> str:
    return str(getattr(key, "value", key))


def offload_staging_bytes(model: torch.nn.Module) -> int:
    """What FSDP2's CPU offload adds on the device and the tracker cannot see (the step runs
    without it): before each all-gather, the unit's sharded parameters copied in from the host
    and cast to the parameter dtype (freed once copied into the all-gather buffer); after each
    reduce-scatter, its output until the copy out to the host ends. At most one unit of each
    at a time: the largest unit's."""
    from torch.distributed.fsdp import FSDPModule

    largest = 0
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        staged = 0
        for param in (param for group in param_groups(module._get_fsdp_state()) for param in group.fsdp_params):
            numel = param.sharded_size.numel()
            reduce_dtype = param.reduce_dtype or param.orig_dtype
            staged += numel * (param.orig_dtype.itemsize + (param.param_dtype or param.orig_dtype).itemsize
                               + reduce_dtype.itemsize)
        largest = max(largest, staged)
    return largest


def _part(parents: set[str]) -> str:
    """Which part of a block is running, from the names of the modules being run."""
    if any(".inner_attention" in name for name in parents):
        return "stage loop"
    # torchtitan's names, then transformers' (self_attn, mlp)
    if any(".attention" in name or ".self_attn" in name for name in parents):
        return "attention"
    if any(".feed_forward" in name or ".moe" in name or ".mlp" in name for name in parents):
        return "mlp"
    return "rest"


@dataclass
class PhaseStats:
    entry: int = -1
    """Device bytes when the phase was first seen."""
    peak: int = 0


class PhaseTracker(ParamGroupsTracker):
    """FSDPMemTracker (over every parameter group) that also keeps the device peak of each phase of the step."""

    def __init__(self, model, optimizer, checkpointed=None, offloaded_state: bool = False):
        """``checkpointed``: the modules activation checkpointing reruns in backward (default:
        the CheckpointWrapper-wrapped ones, torchtitan's). ``offloaded_state``: FSDP keeps the
        :data:`OFFLOADED_STATE_KINDS` on the host and the optimizer steps there (its
        temporaries too): they leave the device's count for :attr:`host_state_peak`."""
        super().__init__(model, optimizer)
        self.offloaded_state = offloaded_state
        self.host_state_peak = 0
        """The most host memory the offloaded state took (with the optimizer step's temporaries)."""
        self.outside_model = "setup"
        """What runs when no model module does: set by the step (loss, clip, ...)."""
        self.phases: dict[tuple, PhaseStats] = defaultdict(PhaseStats)
        self.peak_phase: tuple | None = None
        self._recomputing = False
        self._recompute_hooks = []
        if checkpointed is None:
            checkpointed = [m._checkpoint_wrapped_module for m in model.modules() if isinstance(m, CheckpointWrapper)]
        self._checkpointed = list(checkpointed)

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Off while torch.compile traces (the fusion route compiles attention modules during
        # the step, see eager_twins.py), on while the compiled code runs: the step is counted,
        # the compiler's own fake tensors are not.
        return True

    def __enter__(self):
        # torchtitan puts the checkpoint inside each FSDP block, so FSDPMemTracker's own AC flag
        # (set by FSDP's pre-forward in backward) never rises: watch the checkpointed modules.
        for module in self._checkpointed:
            self._recompute_hooks += [
                module.register_forward_pre_hook(lambda *_: self._set_recomputing(self._mod_tracker.is_bw)),
                module.register_forward_hook(lambda *_: self._set_recomputing(False), always_call=True),
            ]
        entered = super().__enter__()
        if self.offloaded_state and DEVICE in self._peak_mem_snap:  # the peak starts at what is there
            self._peak_mem_snap[DEVICE] = self._without_offloaded_state(self._peak_mem_snap[DEVICE])
            self._peak_mem[DEVICE] = self._peak_mem_snap[DEVICE]["Total"]
        return entered

    def __exit__(self, *args):
        for hook in self._recompute_hooks:
            hook.remove()
        self._recompute_hooks = []
        return super().__exit__(*args)

    def _fsdp_state_pre_forward(self, fsdp_mod, orig_fsdp_state_pre_fw):
        inner = super()._fsdp_state_pre_forward(fsdp_mod, orig_fsdp_state_pre_fw)

        def pre_forward(*args, **kwargs):
            # torchtitan 0.3's ChunkedLossWrapper calls lm_head (an FSDP module) once per chunk,
            # which FSDPMemTracker takes for a second iteration and refuses: each call starts
            # that module's statistics afresh.
            if self.outside_model.startswith("loss") and not self._mod_tracker.is_bw:
                self.memory_tracking.pop(fsdp_mod, None)
            return inner(*args, **kwargs)

        return pre_forward

    def _set_recomputing(self, value: bool) -> None:
        self._recomputing = value

    def _track_optimizer_states(self, reftype, optimizer) -> None:
        # torchtitan's OptimizersContainer keeps the state in its per-model-part optimizers.
        for inner in getattr(optimizer, "optimizers", [optimizer]):
            super()._track_optimizer_states(reftype, inner)

    def phase(self) -> tuple:
        if self._in_opt:
            return ("optimizer step",)
        parents = self._mod_tracker.parents
        if not self._mod_tracker.is_bw:
            direction = "forward"
        else:  # in backward, a block's forward again is activation checkpointing's recompute
            direction = "recompute" if self._recomputing else "backward"
        layers = [int(m.group(1)) for name in parents if (m := _LAYER.search(name))]
        if layers:
            return (direction, max(layers), _part(parents))
        # a model module outside the blocks (embedding, final norm, output), unless the loss
        # runs it (0.3's chunked loss calls lm_head itself)
        if len(parents) > 1 and not self.outside_model.startswith("loss"):
            return (direction, "outside blocks")
        return (self.outside_model + (" backward" if self._mod_tracker.is_bw else ""),)

    def _update_peak_stats(self, peak_state) -> None:
        # torch's MemTracker also keeps each running module's own peak, walking every module it
        # tracks on every op (a third of a long estimate's time); nothing here reads those, so
        # only its per-device peak and the snapshot at it are kept, as it keeps them.
        previous_peak = self._peak_mem.get(DEVICE, 0)
        snaps = self._curr_mem_snap  # runs on every op: a copy only where the state is moved
        if self.offloaded_state and DEVICE in snaps:
            snaps = {**snaps, DEVICE: self._without_offloaded_state(snaps[DEVICE])}
        for device, device_snap in snaps.items():
            if device_snap is not None and self._peak_mem.get(device, 0) < device_snap["Total"]:
                self._peak_mem[device] = device_snap["Total"]
                self._peak_mem_snap[device] = deepcopy(device_snap)
        snap = snaps.get(DEVICE)
        if snap is None:  # no device yet, or the optimizer step of an offloaded state (on the host)
            return
        total, phase = snap["Total"], self.phase()
        stats = self.phases[phase]
        if stats.entry < 0:
            stats.entry = total
        stats.peak = max(stats.peak, total)
        if self._peak_mem.get(DEVICE, 0) > previous_peak:
            self.peak_phase = phase

    def _without_offloaded_state(self, snap: dict) -> dict | None:
        """The device's snapshot with the offloaded state moved to the host's count (None in
        the optimizer step, which runs on the host: its temporaries are counted there)."""
        offloaded = sum(v for k, v in snap.items() if _kind(k) in OFFLOADED_STATE_KINDS)
        if self._in_opt:
            temps = sum(v for k, v in snap.items() if _kind(k) == "Temp")
            self.host_state_peak = max(self.host_state_peak, offloaded + temps)
            return None
        self.host_state_peak = max(self.host_state_peak, offloaded)
        moved = {k: (0 if _kind(k) in OFFLOADED_STATE_KINDS else v) for k, v in snap.items()}
        moved["Total"] = snap["Total"] - offloaded
        return moved

    def device_peak_snapshot(self) -> dict[str, int]:
        return dict(self._peak_mem_snap.get(DEVICE, {}))

    def host_peak(self) -> int:
        return self._peak_mem.get(HOST, 0)


@dataclass
class StepMemory:
    """Raw measurements of one step (bytes)."""

    peak_snapshot: dict[str, int]
    peak_phase: tuple
    phases: dict[tuple, PhaseStats]
    host_peak: int
    host_state_peak: int
    """The state FSDP offloads to the host, at its most (0: none offloaded)."""
    checkpointed_on_device: int
    logits: int
    after_forward: int


def _local(t: torch.Tensor) -> torch.Tensor:
    """What a tensor holds on this rank: a DTensor's local shard (TP's sequence-parallel
    activations), any other tensor itself."""
    return getattr(t, "_local_tensor", t)  # not to_local(): no autograd op inside a pack hook


class SavedOnDevice:
    """Saved-tensor hooks around the model's forward: the device bytes autograd keeps for
    backward from inside the blocks (under activation checkpointing: the block inputs left on
    device). Parameters and buffers are not counted; packed copies on the host are not either."""

    def __init__(self, tracker: PhaseTracker, model: torch.nn.Module):
        self.tracker = tracker
        self.exclude = {_local(t).untyped_storage()._cdata for t in (*model.parameters(), *model.buffers())}
        self.storages: dict[int, int] = {}

    def pack(self, t):
        phase = self.tracker.phase()
        local = _local(t)
        if local.device == DEVICE and len(phase) == 3 and phase[0] == "forward":
            storage = local.untyped_storage()
            if storage._cdata not in self.exclude:
                self.storages[storage._cdata] = storage.nbytes()
        return t

    @staticmethod
    def unpack(t):
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def run_step(job, fake_mode, *, train_step, fused_kernels: bool = True, cuda_ops: bool = True,
             model_kernels: Sequence[Callable[[], ContextManager]] = (),
             offloaded_state: bool = False) -> StepMemory:
    """One training step of ``job`` (anything with the built ``model`` and its ``optimizers``)
    measured with the optimizer state already there, as in every step of a real run but the
    first. ``train_step(job, tracker) -> StepMemory``: the job source's step (the torchtitan
    integration's ``release_022.estimate.train_step`` / ``release_03.estimate.train_step``). ``fused_kernels``: RMSNorm (and
    ``model_kernels``) allocate what fused kernels do (a GPU's, or inductor's anywhere;
    plain_loops.py), else what eager CPU torch allocates; ``cuda_ops``: the embedding's backward
    allocates what CUDA's kernel does. ``offloaded_state``: the job's FSDP offloads its state to
    the host (:class:`PhaseTracker`)."""
    with fake_mode:
        _create_optimizer_state(job)
        tracker = PhaseTracker(job.model, job.optimizers, offloaded_state=offloaded_state)
        with kernel_models(fused_kernels, cuda_ops, model_kernels), tracker:
            return train_step(job, tracker)


def kernel_models(fused_kernels: bool, cuda_ops: bool,
                  model_kernels: Sequence[Callable[[], ContextManager]] = ()) -> ExitStack:
    """The GPU kernels' allocations in place of eager CPU torch's (plain_loops.py): RMSNorm as a
    fused kernel, the embedding's backward as CUDA's. ``model_kernels``: what a job source
    counts as fused kernels in its own models (the torchtitan integration's Llama3 RoPE), each
    a context manager factory, entered with the fused kernels."""
    stack = ExitStack()
    if fused_kernels:
        stack.enter_context(fused_rms_norm())
        for model_kernel in model_kernels:
            stack.enter_context(model_kernel())
    if cuda_ops:
        stack.enter_context(cuda_embedding_backward())
    return stack


def measured(tracker: PhaseTracker, saved: SavedOnDevice, logits: int, after_forward: int) -> StepMemory:
    return StepMemory(
        peak_snapshot=tracker.device_peak_snapshot(), peak_phase=tracker.peak_phase, phases=dict(tracker.phases),
        host_peak=tracker.host_peak(), host_state_peak=tracker.host_state_peak,
        checkpointed_on_device=saved.total, logits=logits, after_forward=after_forward,
    )


def _create_optimizer_state(job) -> None:
    """What a first step leaves behind for memory: the optimizer state (Adam's moments), made
    by one optimizer step on zero gradients. (A whole untracked first step would do the same
    in twice the time.)"""
    for param in job.model.parameters():
        param.grad = torch.zeros_like(param)
    job.optimizers.step()
    job.optimizers.zero_grad()
