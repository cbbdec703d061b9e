"""Peak memory of the attention op at real scale, measured without the memory.

Runs the real stage loops on fake tensors over a fake process group, under
``torch.distributed._tools.mem_tracker.MemTracker``: every allocation the loops make is
counted, no data exists, and a 1M-token layer takes well under a second on a CPU.

What is reported is the op's peak *beyond its own inputs and outputs* (q, k, v, dout live
before the call; out, lse, dq, dk, dv are what it returns): the intermediate memory that
UPipe's stage loop is meant to shrink from O(H) to O(U).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.overrides import TorchFunctionMode

from upipe_compile.measure import workspace
from upipe_compile.attention.kernels import DEFAULT_CUDA_KERNEL
from upipe_compile.attention.document_boundaries import Documents, documents_of
from upipe_compile.errors import UnsupportedAttention
from upipe_compile.attention.ops import op_arguments, replay_backward, save_for_backward
from upipe_compile.attention.stage_loop import DEFAULT_PREFETCH, StageLoopSettings
from upipe_compile.passes.find import SDPA_SIGNATURE
from upipe_compile.attention.checks import AttentionCall, attention_problems
from upipe_compile.attention.head_dims import cut_to_value_dim, one_head_dim
from upipe_compile.attention.schedule import plan_stages
from upipe_compile.attention.stage_loop import stage_loop_backward, stage_loop_forward


@contextlib.contextmanager
def fake_process_group(world: int):
    """A fake default process group of ``world`` ranks (this process is rank 0)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a default process group already exists; measure memory in a fresh process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@dataclass(frozen=True)
class OpMemory:
    forward_bytes: int
    """Forward peak beyond q, k, v and the returned out + lse."""
    backward_bytes: int
    """Backward peak beyond q, k, v, out, lse, dout and the returned dq, dk, dv."""

    @property
    def peak_bytes(self) -> int:
        return max(self.forward_bytes, self.backward_bytes)


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def tracker_peak_bytes(tracker: MemTracker) -> int:
    """Peak bytes a MemTracker saw, over all devices."""
    return sum(stats["Total"] for stats in tracker.get_tracker_snapshot("peak").values())


def modelled_kernel(cuda_kernel: str | None):
    """The context that makes fake-tensor runs allocate CUDA kernel ``cuda_kernel``'s
    workspace (one of :data:`upipe_compile.attention.kernels.CUDA_KERNELS`); None: CPU kernels only."""
    return contextlib.nullcontext() if cuda_kernel is None else workspace.modelled_cuda_kernel(cuda_kernel)


def measure_op_memory(
    group: dist.ProcessGroup, *, seq: int, q_heads: int, kv_heads: int, head_dim: int,
    heads_per_stage: int, batch: int = 1, dtype: torch.dtype = torch.bfloat16, is_causal: bool = True,
    prefetch: str = DEFAULT_PREFETCH, cuda_kernel: str | None = DEFAULT_CUDA_KERNEL, cu_seqlens=None,
) -> OpMemory:
    """Peak intermediate memory of one rank's forward and backward of the stage-loop op,
    with the workspace of CUDA kernel ``cuda_kernel`` counted (None: the CPU kernels').
    ``cu_seqlens`` (a sequence of ints over the full sequence): a packed sequence of those
    documents (the CPU kernels then really run once per document)."""
    world = group.size()
    s_local = seq // world
    with FakeTensorMode(), modelled_kernel(cuda_kernel):
        q = torch.empty(batch, q_heads, s_local, head_dim, dtype=dtype)
        k = torch.empty(batch, kv_heads, s_local, head_dim, dtype=dtype)
        v = torch.empty_like(k)
        dout = torch.empty_like(q)
        documents = None if cu_seqlens is None else Documents.from_bounds(cu_seqlens, q.device)
        settings = StageLoopSettings(is_causal, None, heads_per_stage, world, group.group_name, prefetch)

        forward = MemTracker()
        forward.track_external(q, k, v)
        with forward:
            out, lse = stage_loop_forward(q, k, v, settings, documents)
            forward_peak = tracker_peak_bytes(forward)
        forward_bytes = forward_peak - _nbytes(q, k, v, out, lse)

        backward = MemTracker()
        backward.track_external(q, k, v, out, lse, dout)
        with backward:
            dq, dk, dv, _ = stage_loop_backward(dout, q, k, v, out, lse, settings, documents)
            backward_peak = tracker_peak_bytes(backward)
        backward_bytes = backward_peak - _nbytes(q, k, v, out, lse, dout, dq, dk, dv)
    return OpMemory(forward_bytes, backward_bytes)


_eager_call_counters: list = []
"""The counters of the :func:`counting_eager_calls` blocks now open (innermost last). Not a
context variable: a recompute runs in autograd's device threads, which do not see one."""


@contextlib.contextmanager
def counting_eager_calls():
    """A Counter of the ops' eager twins' forward calls made inside the block ("stage-loop op",
    "fused block"), recompute included: what a whole-model measurement actually ran. Nothing
    is counted outside such a block, so no measurement inherits an earlier one's calls."""
    calls = Counter()
    _eager_call_counters.append(calls)
    try:
        yield calls
    finally:
        _eager_call_counters.remove(calls)


def count_eager_call(kind: str) -> None:
    if _eager_call_counters:
        _eager_call_counters[-1][kind] += 1


class StageLoopFunction(torch.autograd.Function):
    """The op's forward and backward loops as an autograd.Function, for measuring whole
    layers on fake tensors: the registered custom op would run only its fake kernel there.
    Saves and replays exactly as the custom op does (:func:`upipe_compile.attention.ops.save_for_backward`,
    :func:`~upipe_compile.attention.ops.replay_backward`). ``boundaries_or_positions``: the op's
    ``cu_seqlens`` (real values, read as the op reads them); None: one sequence per batch row."""

    @staticmethod
    def forward(ctx, q, k, v, settings: StageLoopSettings, sinks=None, alibi_slopes=None,
                boundaries_or_positions=None):
        count_eager_call("stage-loop op")
        documents = documents_of(boundaries_or_positions, q.shape[2], settings.group_name, q.device,
                                 settings.ring_group_name)
        out, lse = stage_loop_forward(q, k, v, settings, documents, sinks=sinks, alibi_slopes=alibi_slopes)
        save_for_backward(ctx, op_arguments(q, k, v, settings, boundaries_or_positions, sinks, alibi_slopes),
                          (out, lse))
        return out

    @staticmethod
    def backward(ctx, dout):
        dq, dk, dv, dsinks = replay_backward(ctx, dout, eager=True)
        return dq, dk, dv, None, dsinks, None, None


class SDPAThroughStageLoops(TorchFunctionMode):
    """While active, every ``F.scaled_dot_product_attention`` call runs as
    :class:`StageLoopFunction` over ``group``: the eager twin of what the "upipe" backend
    compiles SDPA into, for fake-tensor memory measurements of whole models (the whole-step
    estimate), where the compiled custom op would run only its fake kernel. Calls the backend
    would refuse are refused here too, with the same wording. ``ring_group``: ring x
    all-to-all (``group`` is then the all-to-all group)."""

    def __init__(self, group: dist.ProcessGroup, heads_per_stage: int, prefetch: str = DEFAULT_PREFETCH,
                 ring_group: Optional[dist.ProcessGroup] = None):
        super().__init__()
        self.group, self.heads_per_stage, self.prefetch = group, heads_per_stage, prefetch
        self.ring_group_name = "" if ring_group is None else ring_group.group_name

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        call = SDPA_SIGNATURE.bind(*args, **kwargs)
        call.apply_defaults()
        a = call.arguments
        problems = []
        if a["attn_mask"] is not None:
            problems.append("an attention-mask tensor is passed (attn_mask)")
        if a["dropout_p"] != 0.0:
            problems.append(f"attention dropout is on (dropout_p={a['dropout_p']})")
        q, k, v = a["query"], a["key"], a["value"]
        problems += attention_problems(AttentionCall.of(q, k, v, enable_gqa=a["enable_gqa"]), self.group.size(),
                                       self.heads_per_stage)
        if problems:
            raise UnsupportedAttention("upipe cannot run this attention call: " + "; ".join(problems))
        q, k, v, scale, value_dim = one_head_dim(q, k, v, a["scale"])
        settings = StageLoopSettings(a["is_causal"], scale, self.heads_per_stage, self.group.size(),
                                     self.group.group_name, self.prefetch, ring_group_name=self.ring_group_name)
        return cut_to_value_dim(StageLoopFunction.apply(q, k, v, settings), value_dim)


def expected_ratio(q_heads: int, kv_heads: int, world: int, heads_per_stage: int) -> float:
    """The design count (docs/design.md): one stage holds 2*m + 2*k full-sequence heads
    (m = U/P query heads, k KV heads per rank); Ulysses holds 2*Hq/P + 2*Hkv/P. The CUDA
    kernel's workspace is left out: it lives only while a backward kernel runs, which is
    not always when the op peaks."""
    upipe = plan_stages(q_heads, kv_heads, world, heads_per_stage)
    ulysses = plan_stages(q_heads, kv_heads, world, q_heads)
    units = lambda s: 2 * s.q_per_rank + 2 * s.kv_per_rank  # noqa: E731
    return units(upipe) / units(ulysses)
