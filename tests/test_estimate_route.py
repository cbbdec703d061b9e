"""The whole-step estimate runs attention through SDPAThroughStageLoops (eager) where training
runs the "upipe" backend's compiled op. Proof that the two allocate the same: on a fake group
of 2 ranks with real tensors, an attention block compiled with backend "upipe" and the same
block under the route make the same stage-loop calls with the same buffers (every kernel
input, every all-to-all send buffer), give the backward loop the same saved tensors, and
autograd keeps the same bytes for backward over the whole block.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F

import upipe_compile.block.ops as block_ops_module
import upipe_compile.measure.memory as memory_module
import upipe_compile.attention.ops as ops_module
from tests_support import AttentionCase, TinyAttention, make_block_inputs
from upipe_compile import UnsupportedAttention
from upipe_compile.attention import collectives, kernels
from upipe_compile.measure.eager_twins import eager_twin_backend
from upipe_compile.measure.memory import SDPAThroughStageLoops, fake_process_group

WORLD = 2


@pytest.fixture(scope="module")
def group():
    """A fake default group of WORLD ranks for this module (this process is rank 0)."""
    with fake_process_group(WORLD) as world:
        yield world


def _describe(x):
    if isinstance(x, torch.Tensor):  # a size-1 dim's stride says nothing about the layout
        return (tuple(x.shape), x.dtype, tuple(st if n > 1 else None for n, st in zip(x.shape, x.stride())))
    if dataclasses.is_dataclass(x):  # BlockWeights, BlockRegion: field by field
        return (type(x).__name__, tuple(_describe(getattr(x, f.name)) for f in dataclasses.fields(x)))
    if isinstance(x, (list, tuple)):
        return tuple(_describe(item) for item in x)
    if callable(x):  # a region's head fn: each compile extracts its own
        return type(x).__name__
    return x


@contextmanager
def recording(monkeypatch, calls: list):
    """Log every kernel call, every all-to-all send buffer and the stage loops' arguments."""

    def wrap(owner, name, label):
        original = getattr(owner, name)
        signature = inspect.signature(original)

        def logged(*args, **kwargs):
            call = signature.bind(*args, **kwargs)
            call.apply_defaults()  # the same call, whether a default is passed or left out
            calls.append((label, tuple(_describe(a) for a in call.arguments.values())))
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, logged)

    wrap(kernels, "forward", "kernel forward")
    wrap(kernels, "backward", "kernel backward")
    wrap(collectives, "start_all_to_all", "all-to-all (prefetchable)")
    wrap(collectives, "all_to_all", "all-to-all")
    # The compiled op and the route's autograd.Function call the same loops, looked up where each
    # calls them (the route's forward in memory, every backward through ops.replay_backward).
    for owner in (ops_module, memory_module):
        wrap(owner, "stage_loop_forward", "stage loop forward")
        wrap(owner, "stage_loop_backward", "stage loop backward")
    # The fused block: the op and its eager twin both call these from block_ops.
    wrap(block_ops_module, "block_forward", "block loop forward")
    wrap(block_ops_module, "block_backward", "block loop backward")
    yield


class SavedBytes:
    """Unique storages autograd saves for backward (parameters excluded)."""

    def __init__(self, params):
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.storages = {}

    def pack(self, t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.params:
            self.storages[ptr] = t.untyped_storage().nbytes()
        return t

    @property
    def total(self):
        return sum(self.storages.values())


def run_block(model, params, x, dout, monkeypatch, route=None):
    calls = []
    saved = SavedBytes(params)
    x = x.detach().clone().requires_grad_(True)
    with recording(monkeypatch, calls), torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        if route is None:
            out = model(x)
        else:
            with route:
                out = model(x)
    out.backward(dout)
    monkeypatch.undo()
    return calls, saved.total


CASES = [
    AttentionCase(world=WORLD, batch=1, q_heads=8, kv_heads=2, seq_local=32, head_dim=16, heads_per_stage=2,
                  is_causal=True, scale=None, dtype="float32"),  # UPipe U = P, GQA
    AttentionCase(world=WORLD, batch=2, q_heads=4, kv_heads=4, seq_local=16, head_dim=8, heads_per_stage=4,
                  is_causal=True, scale=0.3, dtype="float32"),  # Ulysses (U = all heads), MHA
]


@pytest.mark.parametrize("case", CASES, ids=["upipe-gqa", "ulysses-mha"])
def test_route_allocates_what_the_compiled_op_allocates(group, monkeypatch, case):
    torch._dynamo.reset()
    x, dout = make_block_inputs(case)
    x = x[:, : case.seq_local]  # this rank's shard
    dout = dout[:, : case.seq_local]
    eager = TinyAttention(case)
    # the route models the plain op (upipe::attention), not the fused block
    options = {"cp_mesh": group, "heads_per_stage": case.heads_per_stage, "inner_backend": "aot_eager",
               "fuse_projections": False}
    compiled = torch.compile(eager, backend="upipe", options=options, fullgraph=True)
    run_block(compiled, eager.parameters(), x, dout, monkeypatch)  # compile outside the recording

    compiled_calls, compiled_saved = run_block(compiled, eager.parameters(), x, dout, monkeypatch)
    route = SDPAThroughStageLoops(group, case.heads_per_stage, "forward")
    routed_calls, routed_saved = run_block(eager, eager.parameters(), x, dout, monkeypatch, route=route)

    labels = [label for label, _ in compiled_calls]
    assert labels.count("stage loop forward") == labels.count("stage loop backward") == 1
    assert labels.count("kernel backward") == case.q_heads // case.heads_per_stage  # one per stage
    assert routed_calls == compiled_calls  # same loops, same buffers, same saved q/k/v/out/lse
    assert routed_saved == compiled_saved > 0


@pytest.mark.parametrize("case", CASES, ids=["upipe-gqa", "ulysses-mha"])
def test_fused_route_allocates_what_the_compiled_fused_op_allocates(group, monkeypatch, case):
    """The estimate compiles attention modules with eager_twin_backend (same passes, the fused
    op swapped for BlockFunction): same block loops, kernels, send buffers and saved bytes as
    the ``upipe::attention_block`` op that backend "upipe" compiles."""
    torch._dynamo.reset()
    x, dout = make_block_inputs(case)
    # this rank's shard; contiguous, as the gradient reaching a compiled graph always is
    x, dout = x[:, : case.seq_local].contiguous(), dout[:, : case.seq_local].contiguous()
    eager = TinyAttention(case)
    options = {"cp_mesh": group, "heads_per_stage": case.heads_per_stage, "inner_backend": "aot_eager"}
    compiled = torch.compile(eager, backend="upipe", options=options, fullgraph=True)
    twin = torch.compile(eager, backend=eager_twin_backend, options=options, fullgraph=True)
    for module in (compiled, twin):
        run_block(module, eager.parameters(), x, dout, monkeypatch)  # compile outside the recording

    compiled_calls, compiled_saved = run_block(compiled, eager.parameters(), x, dout, monkeypatch)
    twin_calls, twin_saved = run_block(twin, eager.parameters(), x, dout, monkeypatch)

    labels = [label for label, _ in compiled_calls]
    assert labels.count("block loop forward") == labels.count("block loop backward") == 1
    assert "stage loop forward" not in labels  # fused: no plain op left
    assert labels.count("kernel backward") == case.q_heads // case.heads_per_stage
    assert twin_calls == compiled_calls
    assert twin_saved == compiled_saved > 0


def test_route_refuses_what_the_backend_refuses(group):
    q = torch.randn(1, 4, 8, 8)
    with SDPAThroughStageLoops(group, 2), pytest.raises(UnsupportedAttention, match="attn_mask"):
        F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(8, 8, dtype=torch.bool))
    with SDPAThroughStageLoops(group, 3), pytest.raises(UnsupportedAttention, match="heads_per_stage=3"):
        F.scaled_dot_product_attention(q, q, q, is_causal=True)


def test_activations_offloaded_to_host_device_count_as_host_memory(group):
    """The contract for offload code (integrations/torchtitan/measurement.py): host copies made
    on ``host_device(job_config)`` of a measured job land on "meta", which the step's tracker reports as
    host memory, apart from the device."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from upipe_compile.estimate.step import DEVICE, PhaseTracker
    from types import SimpleNamespace

    from upipe_compile.integrations.torchtitan.measurement import host_device, mark_for_measurement

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    activation_bytes = 32 * 64 * 4

    def offload(t):  # what an offload hook does with a block's saved input
        return t.to(host_device(job)) if t.shape == (32, 64) else t

    def bring_back(t):
        return torch.empty_like(t, device=DEVICE) if t.device == host_device(job) else t

    job = mark_for_measurement(SimpleNamespace(upipe=SimpleNamespace()))  # the estimate's job config
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.randn(32, 64, requires_grad=True)
        tracker = PhaseTracker(model, None)
        with tracker:
            with torch.autograd.graph.saved_tensors_hooks(offload, bring_back):
                out = model(x)
            out.sum().backward()
    assert host_device(SimpleNamespace(upipe=SimpleNamespace())) == torch.device("cpu")  # another job's: real host
    assert tracker.host_peak() == 2 * activation_bytes  # both layers' inputs, until backward
    assert tracker.device_peak_snapshot()["Total"] > 0


def test_rms_norm_counted_as_the_fused_gpu_kernel():
    """On fake CPU tensors F.rms_norm decomposes into activation-sized fp32 temporaries; the
    estimate counts the fused kernel instead: output + fp32 rstd, and autograd keeps input,
    weight and rstd."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from upipe_compile.estimate.plain_loops import fused_rms_norm
    from upipe_compile.measure.memory import tracker_peak_bytes

    def forward_backward(fused: bool):
        with FakeTensorMode():
            norm = torch.nn.RMSNorm(4096, dtype=torch.bfloat16)
            x = torch.empty(1024, 4096, dtype=torch.bfloat16, requires_grad=True)
            saved = []
            tracker = MemTracker()
            tracker.track_external(norm, x)
            with tracker, (fused_rms_norm() if fused else contextlib.nullcontext()):
                with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
                    out = norm(x)
                out.backward(torch.empty_like(out))
                peak = tracker_peak_bytes(tracker)
            return out, x.grad, peak, saved

    out, grad, fused_peak, saved = forward_backward(True)
    plain_out, plain_grad, plain_peak, _ = forward_backward(False)
    assert (out.shape, out.dtype, grad.shape, grad.dtype) == (plain_out.shape, plain_out.dtype, plain_grad.shape,
                                                             plain_grad.dtype)
    assert [(tuple(t.shape), t.dtype) for t in saved] == [
        ((1024, 4096), torch.bfloat16), ((4096,), torch.bfloat16), ((1024, 1), torch.float32)]
    assert fused_peak < plain_peak


def test_embedding_backward_counts_cudas_two_pass_buffers():
    """CUDA's embedding backward sums rows per token id through an fp32 buffer of n / 10 +
    min(n, V) rows beside the [V, D] gradient; the estimate's fake embedding allocates both
    at once (and int64 index buffers), and its gradient is the plain one's shape and dtype."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from upipe_compile.estimate.plain_loops import cuda_embedding_backward
    from upipe_compile.measure.memory import tracker_peak_bytes

    vocab, dim, n = 5000, 256, 20000

    def backward_rise(cuda: bool):
        with FakeTensorMode():
            embedding = torch.nn.Embedding(vocab, dim, dtype=torch.bfloat16)
            ids = torch.empty(1, n, dtype=torch.int64)
            tracker = MemTracker()
            tracker.track_external(embedding, ids)
            with tracker, (cuda_embedding_backward() if cuda else contextlib.nullcontext()):
                out = embedding(ids)
                grad = torch.empty_like(out)
                before = tracker_peak_bytes(tracker)
                out.backward(grad)
                rise = tracker_peak_bytes(tracker) - before
            return embedding.weight.grad, rise

    grad, rise = backward_rise(True)
    plain_grad, plain_rise = backward_rise(False)
    assert (grad.shape, grad.dtype) == (plain_grad.shape, plain_grad.dtype)
    partials = n // 10 + min(n, vocab)
    workspace = partials * dim * 4 + (3 * n + 2 * min(n, vocab) + partials) * 8
    assert plain_rise >= vocab * dim * 2
    assert rise - plain_rise == workspace


def test_llama3_rope_counted_as_a_fused_kernel():
    """Eager, torchtitan's RoPE makes fp32 copies and complex products of q and k; the
    estimate counts a fused kernel instead: the rotated q and k only (same shapes, dtypes)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from torchtitan.models.llama3.model import model as llama3

    from upipe_compile.integrations.torchtitan.release_022.estimate import fused_rope
    from upipe_compile.measure.memory import tracker_peak_bytes

    def rope(fused: bool):
        with FakeTensorMode():
            xq = torch.empty(1, 1024, 8, 128, dtype=torch.bfloat16, requires_grad=True)
            xk = torch.empty(1, 1024, 2, 128, dtype=torch.bfloat16, requires_grad=True)
            freqs = torch.empty(1024, 64, dtype=torch.complex64)
            tracker = MemTracker()
            tracker.track_external(xq, xk, freqs)
            with tracker, (fused_rope() if fused else contextlib.nullcontext()):
                q, k = llama3.apply_rotary_emb(xq, xk, freqs)
                torch.autograd.backward((q, k), (torch.empty_like(q), torch.empty_like(k)))
                peak = tracker_peak_bytes(tracker)
            return q, k, peak

    q, k, fused_peak = rope(True)
    eager_q, eager_k, eager_peak = rope(False)
    assert [(t.shape, t.dtype) for t in (q, k)] == [(t.shape, t.dtype) for t in (eager_q, eager_k)]
    unit = 1024 * 8 * 128 * 2 + 1024 * 2 * 128 * 2  # one bf16 copy of q and k
    freqs = 1024 * 64 * 8
    # inputs, outputs, incoming gradients, input gradients: 4 units and the RoPE table.
    assert fused_peak == 4 * unit + freqs < eager_peak
