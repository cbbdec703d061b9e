"""The attention kernels: the flash-attn adapter for every signature family (2.5, 2.6,
2.7/2.8) driven through CPU stand-ins of its interface, the CUDA refusals, and the CUDA
workspace model used by fake-tensor memory measurements."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

import rank_jobs
from flash_attn_standins import FAMILIES
from tests_support import TOLERANCE, AttentionCase, eager_reference, relative_error
from upipe_compile import UnsupportedAttention
from upipe_compile.attention import kernels
from upipe_compile.attention.kernels import aten_cuda, flash_attn
from upipe_compile.attention.varlen_groups import H100_SMS
from upipe_compile.measure import workspace

SETTINGS = dict(deadline=None, max_examples=40)


def _stage_layout(x: torch.Tensor) -> torch.Tensor:
    """[B, H, S, D] as the stage loop hands it over: a view of [B, S, H, D] storage."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


@settings(**SETTINGS)
@given(
    family=st.sampled_from(sorted(FAMILIES)), batch=st.integers(1, 2), kv_heads=st.sampled_from([1, 2, 3]),
    group=st.sampled_from([1, 2, 4]), seq=st.integers(1, 40), head_dim=st.sampled_from([8, 16, 32, 64]),
    is_causal=st.booleans(), scale=st.one_of(st.none(), st.floats(0.05, 2.0)),
    dtype=st.sampled_from(["float32", "bfloat16"]), seed=st.integers(0, 2**16),
)
def test_flash_attn_adapter_equals_sdpa(family, batch, kv_heads, group, seq, head_dim, is_causal, scale, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    q_heads = kv_heads * group
    torch_dtype = getattr(torch, dtype)

    def randn(heads):
        return torch.randn(batch, heads, seq, head_dim, generator=gen).to(torch_dtype)

    q, k, v, dout = randn(q_heads), randn(kv_heads), randn(kv_heads), randn(q_heads)
    adapter = kernels.FlashAttnKernels(FAMILIES[family]())
    out, lse = adapter.forward(*(_stage_layout(x) for x in (q, k, v)), is_causal, scale)
    dq, dk, dv = adapter.backward(*(_stage_layout(x) for x in (dout, q, k, v, out)), lse, is_causal, scale)

    q_ref, k_ref, v_ref = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    out_ref = F.scaled_dot_product_attention(q_ref, k_ref, v_ref, is_causal=is_causal, scale=scale, enable_gqa=True)
    out_ref.backward(dout)
    scores = (q.double() @ k.double().repeat_interleave(group, 1).transpose(-1, -2)) * (scale or head_dim**-0.5)
    if is_causal:
        scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    tolerance = TOLERANCE[dtype]
    assert out.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert lse.dtype == torch.float32 and relative_error(lse, scores.logsumexp(-1)) < 1e-4  # fp32 sums
    for name, actual, expected in (("out", out, out_ref), ("dq", dq, q_ref.grad), ("dk", dk, k_ref.grad),
                                   ("dv", dv, v_ref.grad)):
        assert relative_error(actual, expected) < tolerance, f"{family} {name}"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_flash_attn_backward_honours_deterministic_algorithms(family):
    interface = FAMILIES[family]()
    adapter = kernels.FlashAttnKernels(interface)
    q = torch.randn(1, 2, 16, 8)
    out, lse = adapter.forward(q, q, q, True, None)
    previous = torch.are_deterministic_algorithms_enabled()
    try:
        for deterministic in (True, False):
            torch.use_deterministic_algorithms(deterministic)
            adapter.backward(q, q, q, q, out, lse, True, None)
            assert interface.calls[-1]["deterministic"] is deterministic
    finally:
        torch.use_deterministic_algorithms(previous)
    windows = [call.get("window_size", (call.get("window_size_left"), -1)) for call in interface.calls]
    assert all(window == (-1, -1) for window in windows)


def test_flash_attn_interface_with_an_unknown_required_parameter_is_refused():
    interface = FAMILIES["2.6"]()
    real_forward = interface._flash_attn_forward

    def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                            return_softmax, sink_tokens):
        return real_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                            return_softmax)

    interface._flash_attn_forward = _flash_attn_forward
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(UnsupportedAttention, match="'sink_tokens'.*2.5 to 2.8"):
        kernels.FlashAttnKernels(interface).forward(q, q, q, False, None)


def test_unknown_parameters_with_defaults_keep_them():
    seen = {}

    def fn(a, b, extra=7, c=None):
        seen.update(a=a, b=b, extra=extra, c=c)

    flash_attn._call(fn, flash_attn._parameters(fn), {"a": 1, "b": 2, "c": 3}, "fn")
    assert seen == {"a": 1, "b": 2, "extra": 7, "c": 3}


def test_custom_op_parameters_come_from_the_schema():
    names = [name for name, _ in flash_attn._parameters(FAMILIES["2.7/2.8"]()._flash_attn_backward)]
    assert names[:9] == ["dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv"]
    assert names[-4:] == ["softcap", "alibi_slopes", "deterministic", "rng_state"]


def test_cuda_refusals_name_the_fix():
    assert kernels.cuda_problems(torch.bfloat16, 128) == []
    assert kernels.cuda_problems(torch.float16, 256) == []
    (fp32,) = kernels.cuda_problems(torch.float32, 128)
    assert "fp16 or bf16" in fp32 and "autocast" in fp32
    (odd,) = kernels.cuda_problems(torch.bfloat16, 100)
    assert "head_dim=100" in odd and "multiple of 8" in odd and "104" in odd
    assert "at most 256" in kernels.cuda_problems(torch.bfloat16, 264)[0]


def test_aten_cuda_markers_are_not_cached_under_fake_mode():
    from upipe_compile.attention import device_constants

    device_constants._cache.clear()
    with FakeTensorMode():
        markers = aten_cuda._aten_cuda_dense_markers(torch.device("cpu"), torch.bfloat16)
    assert len(markers) == 4
    assert device_constants._cache == {}


def test_flash_backward_workspace_table():
    flash, aten = kernels.CUDA_KERNELS["flash-attn"], kernels.CUDA_KERNELS["aten-flash"]
    ws = flash.backward_workspace(1, 4, 1, 1000, 128, torch.bfloat16, False, H100_SMS)
    assert ws == {
        "softmax_d": ((1, 4, 1024), torch.float32),
        "dq_accum": ((1, 1, 1024, 4, 128), torch.float32),
        "dk_expanded": ((1, 1000, 4, 128), torch.bfloat16),
        "dv_expanded": ((1, 1000, 4, 128), torch.bfloat16),
    }
    # deterministic: one dq accumulator per split, until all 132 SMs of an H100 have work
    assert flash.backward_workspace(1, 4, 4, 1000, 80, torch.bfloat16, True, H100_SMS)["dq_accum"][0] == (
        33, 1, 1024, 4, 96)
    aten_ws = aten.backward_workspace(1, 4, 4, 1000, 128, torch.bfloat16, False, H100_SMS)
    assert set(aten_ws) == {"softmax_d", "dq_accum", "dout_contiguous", "out_contiguous"}
    # one head a call: the [B, S, 1, D] view of a [B, 1, S, D] buffer is contiguous, no copies
    assert set(aten.backward_workspace(1, 1, 1, 1000, 128, torch.bfloat16, False, H100_SMS)) == {
        "softmax_d", "dq_accum"}


def _nbytes(workspace) -> int:
    return sum(torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size() for shape, dtype in workspace.values())


@pytest.mark.parametrize("cuda_kernel", sorted(kernels.CUDA_KERNELS))
def test_modelled_cuda_workspace_is_allocated_during_the_fake_backward(cuda_kernel):
    from torch.distributed._tools.mem_tracker import MemTracker

    from upipe_compile.measure.memory import tracker_peak_bytes

    def backward_peak(model: bool) -> int:
        with FakeTensorMode():
            q, dout, out = (torch.empty(1, 4, 4096, 128, dtype=torch.bfloat16) for _ in range(3))
            k = torch.empty(1, 2, 4096, 128, dtype=torch.bfloat16)
            lse = torch.empty(1, 4, 4096)
            tracker = MemTracker()
            tracker.track_external(q, k, dout, out, lse)
            with tracker, (workspace.modelled_cuda_kernel(cuda_kernel) if model else contextlib.nullcontext()):
                grads = kernels.backward(dout, q, k, k, out, lse, True, None)
                peak = tracker_peak_bytes(tracker)
            del grads
            return peak

    expected = _nbytes(kernels.CUDA_KERNELS[cuda_kernel].backward_workspace(1, 4, 2, 4096, 128, torch.bfloat16, False,
                                                                          H100_SMS))
    assert backward_peak(True) - backward_peak(False) == expected


def test_op_measurement_counts_the_modelled_workspace():
    from upipe_compile.measure.memory import fake_process_group, measure_op_memory

    seq, world = 2**16, 4
    shape = dict(seq=seq, q_heads=8, kv_heads=2, head_dim=128, heads_per_stage=8)
    with fake_process_group(world) as group:
        cpu = measure_op_memory(group, **shape, cuda_kernel=None)
        flash = measure_op_memory(group, **shape, cuda_kernel="flash-attn")
    # Ulysses here: 2 q heads and 1 KV head per rank -> the kernel expands dK/dV to 2 heads
    kernel_bytes = _nbytes(kernels.FlashAttnKernels.backward_workspace(1, 2, 1, seq, 128, torch.bfloat16, False, H100_SMS))
    assert flash.forward_bytes == cpu.forward_bytes
    assert cpu.backward_bytes < flash.backward_bytes <= cpu.backward_bytes + kernel_bytes


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("kv_heads, heads_per_stage", [(8, 2), (2, 2), (2, 8)])
def test_stage_loop_through_flash_attn_adapter_equals_eager(rank_pools, family, kv_heads, heads_per_stage):
    """The op on 2 gloo ranks with FlashAttnKernels (what CUDA runs) equals eager SDPA."""
    for dtype in ("float32", "bfloat16"):
        case = AttentionCase(world=2, batch=1, q_heads=8, kv_heads=kv_heads, seq_local=24, head_dim=16,
                             heads_per_stage=heads_per_stage, is_causal=True, scale=None, dtype=dtype, seed=3)
        results = rank_pools(2).run(rank_jobs.op_case_with_flash_standin, case, family)
        expected = eager_reference(case)
        for i, name in enumerate(("out", "dq", "dk", "dv")):
            actual = torch.cat([r[i] for r in results], dim=2)
            assert relative_error(actual, expected[i]) < TOLERANCE[dtype], f"{family} {dtype} {name}"


@pytest.mark.parametrize("path", ["op", "unfused", "fused"])
def test_uneven_shards_refused_on_every_rank_also_at_a_length_a_rank_has_seen(rank_pools, path):
    """Step 1 even; step 2 rank 0 at the length it saw (its compiled graph is reused), rank 1
    at a new one: both ranks refuse instead of one waiting in a check the other skipped (a
    hang until the collective timeout); step 3 even again: the group still works."""
    lengths = [[4, 4, 4], [4, 6, 4]]
    per_rank = rank_pools(2).run(rank_jobs.shard_lengths_in_turn, path, lengths)
    for rank, outcomes in enumerate(per_rank):
        assert outcomes[0] == outcomes[2] == "ok", (rank, outcomes)
        assert "equal, contiguous shard" in outcomes[1], (rank, outcomes)
        shapes = {"op": "[[1, 4, 4, 4, 8], [1, 4, 4, 6, 8]]", "unfused": "[[1, 4, 2, 4, 8], [1, 4, 2, 6, 8]]",
                  "fused": "[[1, 4, 32], [1, 6, 32]]"}[path]
        assert f"local shapes per rank: {shapes}" in outcomes[1], (rank, outcomes)


def test_ranks_running_different_graphs_meet_in_the_shape_check(rank_pools):
    """Ranks whose compiled graphs differ (as after a recompile on one rank only, which turns
    its sequence length dynamic and its block unfused): rank 0 runs the fused block, rank 1
    the plain loop, at the same length. Their checks still meet in one all-gather (a
    mismatched collective would abort gloo or hang NCCL) and both ranks refuse."""
    per_rank = rank_pools(2).run(rank_jobs.shard_lengths_in_turn, ["fused", "unfused"], [[4], [4]])
    for outcomes in per_rank:
        assert "local shapes per rank: [[1, 4, 32], [1, 4, 2, 4, 8]]" in outcomes[0], per_rank


def test_shape_check_gathers_host_integers_only(rank_pools):
    """The check's all-gather takes host tensors over a host group, so on CUDA it neither
    syncs with nor launches device work (a gloo group is its own host group)."""
    per_rank = rank_pools(2).run(rank_jobs.shape_check_tensors)
    for devices, same_group in per_rank:
        assert devices == {"cpu"} and same_group


@pytest.mark.parametrize("dtype, head_dim, expected", [
    (torch.bfloat16, 100, "head_dim=100"), (torch.float32, 128, "fp16 or bf16"), (torch.bfloat16, 128, None),
])
def test_cuda_inputs_the_kernels_cannot_take_are_refused_at_compile_time(dtype, head_dim, expected):
    import torch.fx as fx

    from upipe_compile.passes import find_attention, unsupported_reasons

    def attention(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    gm = fx.symbolic_trace(attention)
    with FakeTensorMode():
        example = torch.empty(1, 8, 64, head_dim, dtype=dtype, device="cuda")
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            node.meta["example_value"] = example
    (match,) = find_attention(gm)
    reasons = unsupported_reasons(match, world=2, heads_per_stage=2)
    if expected is None:
        assert reasons == []
    else:
        assert len(reasons) == 1 and expected in reasons[0]


@settings(**SETTINGS)
@given(
    family=st.sampled_from(sorted(FAMILIES)), batch=st.integers(1, 2), kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2]), seq=st.integers(1, 24), is_causal=st.booleans(), data=st.data(),
)
def test_flash_attn_varlen_adapter_equals_per_document_kernel(family, batch, kv_heads, group, seq, is_causal, data):
    """FlashAttnKernels' packed path (varlen functions; padded LSE in 2.5, packed after)
    equals the CPU kernel run per document: out, the packed LSE, dq, dk, dv."""
    from upipe_compile.attention.document_boundaries import Documents

    cuts = sorted(data.draw(st.sets(st.integers(1, seq - 1), max_size=seq - 1))) if seq > 1 else []
    documents = Documents.from_bounds((0, *cuts, seq), "cpu")
    gen = torch.Generator().manual_seed(seq)
    q, k, v, dout = (_stage_layout(torch.randn(batch, h, seq, 16, generator=gen))
                     for h in (kv_heads * group, kv_heads, kv_heads, kv_heads * group))
    flash, cpu = kernels.FlashAttnKernels(FAMILIES[family]()), kernels.CpuKernels()
    results = []
    for kernel in (flash, cpu):
        out, lse = kernel.forward_documents(q, k, v, documents, is_causal, None)
        results.append((out, lse, *kernel.backward_documents(dout, q, k, v, out, lse, documents, is_causal, None)))
    for name, actual, expected in zip(("out", "lse", "dq", "dk", "dv"), *results):
        assert actual.shape == expected.shape and relative_error(actual, expected) < 1e-5, f"{family} {name}"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_packed_stage_loop_through_flash_attn_adapter_equals_eager(rank_pools, family):
    """The packed op on 2 gloo ranks through FlashAttnKernels' varlen path equals eager SDPA
    per document (a document crossing the shard boundary, one of length 1, GQA, U > P)."""
    from tests_support import eager_documents_reference

    case = AttentionCase(world=2, batch=1, q_heads=8, kv_heads=2, seq_local=12, head_dim=16, heads_per_stage=4,
                         is_causal=True, scale=None, dtype="float32", seed=5)
    bounds = (0, 5, 6, 19, 24)
    results = rank_pools(2).run(rank_jobs.op_case_with_flash_standin, case, family, bounds)
    expected = eager_documents_reference(case, bounds)
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        actual = torch.cat([r[i] for r in results], dim=2)
        assert relative_error(actual, expected[i]) < TOLERANCE["float32"], f"{family} {name}"


@pytest.mark.parametrize("batch", [1, 2])
def test_aten_cuda_varlen_calls_match_the_op_schemas(batch):
    """No GPU here: on meta tensors aten's varlen flash forward/backward check the arguments
    AtenCudaKernels passes (order, int32 cumulative lengths, [S, H, D] views) and return the
    packed [H, S] log-sum-exp its backward is handed back."""
    from upipe_compile.attention.document_boundaries import Documents

    documents = Documents.from_bounds((0, 5, 6, 32), "meta")
    q = torch.empty(batch, 4, 32, 64, device="meta", dtype=torch.bfloat16)
    k = torch.empty(batch, 2, 32, 64, device="meta", dtype=torch.bfloat16)
    kernel = kernels.AtenCudaKernels()
    out, lse = kernel.forward_documents(q, k, k, documents, True, None)
    assert out.shape == q.shape and lse.shape == (batch, 4, 32) and kernel.lse_padded is False
    dq, dk, dv = kernel.backward_documents(q, q, k, k, out, lse, documents, True, None)
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape


# --- sliding window and softcap -------------------------------------------------------------

def _variant_reference(q, k, v, dout, is_causal, scale, window, softcap, documents=None):
    """(out, lse, dq, dk, dv) computed as the stand-ins compute them (aten's CPU kernel
    without a variant, else the blocked kernel with their block size), per batch row and
    document when packed, on the same views: the adapter has only to route the arguments
    and results. (Two different fp32 kernels can differ by more than 1e-5 in small
    gradients of near-one-hot softmaxes, so the reference is the same kernel.)"""
    from upipe_compile.attention import blocked_kernel

    def pair(q, k, v, dout):
        if tuple(window) == (-1, -1) and not softcap:
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal,
                                                                                   scale=scale)
            return out, lse, *torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout, q, k, v, out, lse, 0.0, is_causal, scale=scale)
        out, lse = blocked_kernel.forward(q, k, v, is_causal, scale, window, softcap, block_rows=16)
        return out, lse, *blocked_kernel.backward(dout, q, k, v, out, lse, is_causal, scale, window, softcap,
                                                     block_rows=16)

    if documents is None:
        return pair(q, k, v, dout)
    results = [torch.empty_like(t) for t in (q, q[..., 0].float(), q, k, v)]
    for row in range(q.shape[0]):
        for a, b in documents.spans:
            pieces = pair(*(t[row:row + 1, :, a:b] for t in (q, k, v, dout)))
            for full, piece in zip(results, pieces):
                full[row:row + 1, :, a:b] = piece
    return results


def _window_edges():
    return st.one_of(st.just(-1), st.just(0), st.integers(1, 6), st.integers(24, 30))


@settings(**SETTINGS)
@given(
    family=st.sampled_from(sorted(FAMILIES)), batch=st.integers(1, 2), kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2]), seq=st.integers(1, 24), is_causal=st.booleans(),
    scale=st.one_of(st.none(), st.floats(0.05, 2.0)), left=_window_edges(), right=_window_edges(),
    softcap=st.one_of(st.just(0.0), st.floats(0.5, 50.0)), packed=st.booleans(), data=st.data(),
)
def test_flash_attn_adapter_passes_window_and_softcap(family, batch, kv_heads, group, seq, is_causal, scale, left,
                                                       right, softcap, packed, data):
    """Every family's dense and varlen paths get the window in their own form (a tuple in
    2.5/2.6, left/right from 2.7) and softcap (2.6+), and equal the exact CPU kernels."""
    from upipe_compile.attention.document_boundaries import Documents

    if family == "2.5":
        softcap = 0.0  # refused there (test_flash_attn_2_5_refuses_softcap)
    window = (left, right)
    documents = None
    if packed and seq > 1:
        cuts = sorted(data.draw(st.sets(st.integers(1, seq - 1), min_size=1, max_size=seq - 1)))
        documents = Documents.from_bounds((0, *cuts, seq), "cpu")
    gen = torch.Generator().manual_seed(seq)
    q, k, v, dout = (_stage_layout(torch.randn(batch, h, seq, 16, generator=gen))
                     for h in (kv_heads * group, kv_heads, kv_heads, kv_heads * group))
    interface = FAMILIES[family]()
    flash = kernels.FlashAttnKernels(interface)
    if documents is None:
        out, lse = flash.forward(q, k, v, is_causal, scale, window, softcap)
        grads = flash.backward(dout, q, k, v, out, lse, is_causal, scale, window, softcap)
    else:
        out, lse = flash.forward_documents(q, k, v, documents, is_causal, scale, window, softcap)
        grads = flash.backward_documents(dout, q, k, v, out, lse, documents, is_causal, scale, window, softcap)
    expected = _variant_reference(q, k, v, dout, is_causal, scale, window, softcap, documents)
    for name, actual, wanted in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), expected):
        assert actual.shape == wanted.shape and relative_error(actual, wanted) < 1e-6, f"{family} {name}"

    for call in interface.calls:
        if family == "2.7/2.8":
            assert (call["window_size_left"], call["window_size_right"], call["softcap"]) == (left, right, softcap)
        else:
            assert tuple(call["window_size"]) == window and call.get("softcap", 0.0) == softcap


def test_flash_attn_2_5_refuses_softcap():
    """2.5 has no softcap parameter: the adapter refuses before calling, naming 2.6; a
    window alone is fine."""
    interface = FAMILIES["2.5"]()
    flash = kernels.FlashAttnKernels(interface)
    (problem,) = flash.variant_problems((-1, -1), 30.0)
    assert "2.5.9" in problem and "softcap" in problem and ">= 2.6" in problem
    assert flash.variant_problems((8, 0), 0.0) == []
    q = torch.randn(1, 2, 8, 8)
    with pytest.raises(UnsupportedAttention, match=r"2\.5\.9 has no softcap parameter in _flash_attn_forward "):
        flash.forward(q, q, q, True, None, (-1, -1), 30.0)
    with pytest.raises(UnsupportedAttention, match="no softcap parameter in _flash_attn_backward "):
        flash.backward(q, q, q, q, q, torch.zeros(1, 2, 8), True, None, (-1, -1), 30.0)
    from upipe_compile.attention.document_boundaries import Documents

    documents = Documents.from_bounds((0, 3, 8), "cpu")
    with pytest.raises(UnsupportedAttention, match="no softcap parameter in _flash_attn_varlen_forward "):
        flash.forward_documents(q, q, q, documents, True, None, (-1, -1), 30.0)
    assert interface.calls == []  # refused before any call


def test_flash_attn_interface_without_window_parameters_refuses_a_window():
    """A window is never dropped: an interface whose functions lack window_size is refused."""
    interface = FAMILIES["2.6"]()
    real_forward = interface._flash_attn_forward

    def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, softcap, alibi_slopes, return_softmax):
        return real_forward(q, k, v, dropout_p, softmax_scale, causal, (-1, -1), softcap, alibi_slopes, return_softmax)

    interface._flash_attn_forward = _flash_attn_forward
    flash = kernels.FlashAttnKernels(interface)
    assert "no window_size parameter in _flash_attn_forward;" in flash.variant_problems((4, 0), 0.0)[0]
    q = torch.randn(1, 2, 8, 8)
    flash.forward(q, q, q, True, None)  # no window: fine
    with pytest.raises(UnsupportedAttention, match="no window_size parameter in _flash_attn_forward"):
        flash.forward(q, q, q, True, None, (4, 0))


def test_cuda_variant_problems_name_the_fix(monkeypatch):
    """kernels.variant_problems("cuda", ...) asks the kernel CUDA would use."""
    monkeypatch.setattr(kernels, "_cuda_kernels", lambda: kernels.AtenCudaKernels())
    assert kernels.variant_problems("cuda", (128, 0), 0.0) == []  # torch 2.13's aten flash takes a window
    (softcap,) = kernels.variant_problems("cuda", (-1, -1), 50.0)
    assert "aten's CUDA flash" in softcap and "flash-attn >= 2.6" in softcap
    monkeypatch.setattr(aten_cuda, "_aten_flash_takes_window", lambda: False)
    (window,) = kernels.variant_problems("cuda", (128, 0), 0.0)
    assert "window_size_left/right" in window and "install flash-attn" in window
    assert kernels.variant_problems("cuda", (-1, -1), 0.0) == []

    monkeypatch.setattr(kernels, "_cuda_kernels", lambda: kernels.FlashAttnKernels(FAMILIES["2.5"]()))
    (old,) = kernels.variant_problems("cuda", (128, 0), 30.0)
    assert "2.5.9" in old and ">= 2.6" in old
    for family in ("2.6", "2.7/2.8"):
        monkeypatch.setattr(kernels, "_cuda_kernels", lambda f=family: kernels.FlashAttnKernels(FAMILIES[f]()))
        assert kernels.variant_problems("cuda", (128, 0), 30.0) == []
    assert "int >= -1" in kernels.variant_problems("cuda", (-3, 0), 0.0)[0]


def test_torch_aten_flash_schemas_take_the_window():
    assert aten_cuda._aten_flash_takes_window()


@pytest.mark.parametrize("batch", [1, 2])
def test_aten_cuda_window_calls_match_the_op_schemas(batch):
    """No GPU here: on meta tensors aten's flash forward/backward check the arguments
    AtenCudaKernels passes with a window, dense ([B, S, H, D] views, no cumulative
    lengths, as torch's SDPA calls them) and varlen; softcap is refused."""
    from upipe_compile.attention.document_boundaries import Documents

    q = _stage_layout(torch.empty(batch, 4, 32, 64, device="meta", dtype=torch.bfloat16))
    k = _stage_layout(torch.empty(batch, 2, 32, 64, device="meta", dtype=torch.bfloat16))
    kernel = kernels.AtenCudaKernels()
    out, lse = kernel.forward(q, k, k, True, None, (16, 0))
    assert out.shape == q.shape and lse.shape == (batch, 4, 32)
    dq, dk, dv = kernel.backward(q, q, k, k, out, lse, True, None, (16, 0))
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape

    documents = Documents.from_bounds((0, 5, 6, 32), "meta")
    out, lse = kernel.forward_documents(q, k, k, documents, False, None, (3, 3))
    assert out.shape == q.shape and lse.shape == (batch, 4, 32)
    dq, dk, dv = kernel.backward_documents(q, q, k, k, out, lse, documents, False, None, (3, 3))
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape

    with pytest.raises(UnsupportedAttention, match="flash-attn >= 2.6"):
        kernel.forward(q, k, k, True, None, (-1, -1), 30.0)
    with pytest.raises(UnsupportedAttention, match="flash-attn >= 2.6"):
        kernel.backward_documents(q, q, k, k, out, lse, documents, True, None, (-1, -1), 30.0)


@settings(**SETTINGS)
@given(
    q_len=st.integers(1, 20), k_len=st.integers(1, 20), kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2]), is_causal=st.booleans(), left=_window_edges(), right=_window_edges(),
    softcap=st.one_of(st.just(0.0), st.floats(0.5, 50.0)),
)
def test_unequal_lengths_align_the_window_to_the_last_query_and_key(q_len, k_len, kv_heads, group, is_causal, left,
                                                                     right, softcap):
    """The CPU kernels with fewer or more queries than keys (a ring's chunk pair under packed
    documents): query i's window is centred on key i + (k_len - q_len), as flash-attn aligns
    it; out, lse and gradients equal float64 softmax math with that mask."""
    from hypothesis import assume

    shift = k_len - q_len
    i, j = torch.arange(q_len).unsqueeze(-1) + shift, torch.arange(k_len)
    visible = torch.ones(q_len, k_len, dtype=torch.bool)
    if left >= 0:
        visible &= j >= i - left
    right_edge = 0 if is_causal else right
    if right_edge >= 0:
        visible &= j <= i + right_edge
    assume(bool(visible.any(-1).all()))  # the ring only makes calls whose every row sees a key
    gen = torch.Generator().manual_seed(q_len * 31 + k_len)
    q, dout = (torch.randn(1, kv_heads * group, q_len, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(1, kv_heads, k_len, 8, generator=gen, dtype=torch.float64) for _ in range(2))

    def reference(q, k, v):
        scores = q @ k.repeat_interleave(group, 1).transpose(-1, -2) * 8**-0.5
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~visible, float("-inf"))
        return scores.softmax(-1) @ v.repeat_interleave(group, 1), scores.logsumexp(-1)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want_out, want_lse = reference(*leaves)
    want_grads = torch.autograd.grad(want_out, leaves, dout)
    out, lse = kernels.forward(q, k, v, is_causal, None, None, (left, right), softcap)
    grads = kernels.backward(dout, q, k, v, out, lse, is_causal, None, None, (left, right), softcap)
    for name, actual, wanted in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), (want_out, want_lse,
                                                                                           *want_grads)):
        # lse is float32 in every kernel and the backward reads it: 1e-6, not float64's 1e-12
        assert actual.shape == wanted.shape and torch.allclose(actual.double(), wanted, rtol=1e-6, atol=1e-6), name
