"""Hopper's kernels behind the contract: FlashAttention-3, FlashAttention-4 and cuDNN attention,
each driven through a CPU stand-in with its library's real signature
(tests/flash_attn_standins.py), against the CPU kernel; what each refuses; which one the
registry picks; their backward workspace."""

from __future__ import annotations

import math
import re
import sys

import pytest
import torch

from flash_attn_standins import cudnn_aten_standin, flash_attn_3_interface, flash_attn_4_interface
from test_kernels import _variant_reference
from tests_support import relative_error
from upipe_compile import UnsupportedAttention
from upipe_compile.attention import kernels
from upipe_compile.attention.kernels import cudnn, hopper_family
from upipe_compile.attention.kernels.contract import NO_WINDOW, effective
from upipe_compile.attention.varlen_groups import H100_SMS
from upipe_compile.attention.document_boundaries import Documents

KERNELS = ["flash-attn-3", "flash-attn-4", "cudnn"]


@pytest.fixture
def kernel_of():
    """``make(name)``: the kernel over its stand-in (cuDNN's registered on aten while the test runs)."""
    with cudnn_aten_standin() as cudnn_calls:
        def make(name):
            if name == "flash-attn-3":
                return kernels.FlashAttn3Kernels(flash_attn_3_interface())
            if name == "flash-attn-4":
                return kernels.FlashAttn4Kernels(flash_attn_4_interface())
            kernel = kernels.CudnnKernels()
            kernel.calls = cudnn_calls
            return kernel
        yield make


def _stage_layout(x: torch.Tensor) -> torch.Tensor:
    """[B, H, S, D] as the stage loop hands it over: a view of [B, S, H, D] storage."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _inputs(batch, q_heads, kv_heads, q_len, k_len, seed=0, dim=16):
    gen = torch.Generator().manual_seed(seed)
    make = lambda h, n: _stage_layout(torch.randn(batch, h, n, dim, generator=gen, dtype=torch.float32))  # noqa: E731
    return make(q_heads, q_len), make(kv_heads, k_len), make(kv_heads, k_len), make(q_heads, q_len)


def _run(kernel, q, k, v, dout, is_causal, scale=None, window=NO_WINDOW, softcap=0.0, documents=None):
    if documents is None:
        out, lse = kernel.forward(q, k, v, is_causal, scale, window, softcap)
        return (out, lse, *kernel.backward(dout, q, k, v, out, lse, is_causal, scale, window, softcap))
    out, lse = kernel.forward_documents(q, k, v, documents, is_causal, scale, window, softcap)
    return (out, lse, *kernel.backward_documents(dout, q, k, v, out, lse, documents, is_causal, scale, window, softcap))


def _assert_equal(actual, expected, label):
    for name, a, e in zip(("out", "lse", "dq", "dk", "dv"), actual, expected):
        assert a.shape == e.shape, f"{label} {name}: {tuple(a.shape)} vs {tuple(e.shape)}"
        assert a.dtype == e.dtype, f"{label} {name}: {a.dtype} vs {e.dtype}"
        assert relative_error(a, e) < 1e-6, f"{label} {name}"


@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize("batch, q_heads, kv_heads, q_len, k_len, is_causal", [
    (2, 4, 1, 24, 24, True),    # GQA, causal
    (1, 4, 2, 20, 20, False),   # GQA
    (1, 2, 2, 17, 17, True),    # MHA, a length no tile divides
    (1, 4, 2, 8, 24, False),    # fewer queries than keys (a ring's chunk pair)
])
def test_kernel_equals_the_cpu_kernel(kernel_of, name, batch, q_heads, kv_heads, q_len, k_len, is_causal):
    """out, the [B, Hq, S] float32 log-sum-exp, dq/dk/dv (dk/dv with k's head count) equal
    aten's CPU kernel on the same stage-layout views."""
    q, k, v, dout = _inputs(batch, q_heads, kv_heads, q_len, k_len)
    actual = _run(kernel_of(name), q, k, v, dout, is_causal, scale=0.3)
    expected = _run(kernels.CpuKernels(), q, k, v, dout, is_causal, scale=0.3)
    assert actual[1].shape == (batch, q_heads, q_len) and actual[1].dtype == torch.float32
    _assert_equal(actual, expected, name)


@pytest.mark.parametrize("name", ["flash-attn-3", "flash-attn-4"])
@pytest.mark.parametrize("window, softcap, packed", [
    ((4, 0), 0.0, False), ((3, 2), 0.0, False), ((-1, 3), 20.0, False), ((-1, -1), 5.0, False),
    ((5, 0), 10.0, True), ((-1, 2), 0.0, True),
])
def test_flash_3_and_4_pass_window_and_softcap(kernel_of, name, window, softcap, packed):
    """Windows and softcap (declared by FA3 and FA4), dense and packed, equal the CPU kernel,
    and reach the library in its own spelling (FA4: None for an unbounded edge, -1 never)."""
    kernel = kernel_of(name)
    q, k, v, dout = _inputs(2, 4, 2, 24, 24, seed=1)
    documents = Documents.from_bounds((0, 7, 8, 24), "cpu") if packed else None
    for is_causal in (True, False):
        causal, plain = effective(is_causal, window, 24, 24)
        actual = _run(kernel, q, k, v, dout, causal, None, plain, softcap, documents)
        # the stand-ins' own blocked kernel (block_rows=16): two fp32 kernels differ by more than 1e-6
        expected = _variant_reference(q, k, v, dout, causal, None, plain, softcap, documents)
        _assert_equal(actual, expected, f"{name} {window} {softcap} causal={is_causal}")
        for call in kernel.interface.calls:
            assert call["varlen"] is packed
            if name == "flash-attn-4":
                assert call["window"] == tuple(None if e < 0 else e for e in plain)
                assert call["softcap"] in ((softcap or None), softcap)
            else:
                assert call["window"] == plain and call["softcap"] == softcap
        kernel.interface.calls.clear()


@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize("bounds", [(0, 5, 6, 19, 24), (0, 1, 24), (0, 24)])
def test_packed_documents_equal_the_cpu_kernel(kernel_of, name, bounds):
    """Packed documents (FA3/FA4: their varlen form; cuDNN: one dense call per document, a
    one-token document computed without cuDNN, which refuses a single key) equal aten's CPU
    kernel per document, GQA and two batch rows included."""
    q, k, v, dout = _inputs(2, 4, 2, 24, 24, seed=2)
    documents = Documents.from_bounds(bounds, "cpu")
    for is_causal in (True, False):
        actual = _run(kernel_of(name), q, k, v, dout, is_causal, documents=documents)
        expected = _run(kernels.CpuKernels(), q, k, v, dout, is_causal, documents=documents)
        _assert_equal(actual, expected, f"{name} {bounds} causal={is_causal}")


def test_cudnn_standin_refuses_a_single_key(kernel_of):
    """The stand-in refuses S_kv = 1 as cuDNN does, so the one-key path above is the adapter's."""
    kernel_of("cudnn")
    q = torch.randn(1, 2, 1, 8)
    with pytest.raises(RuntimeError, match="key/value sequence length 1"):
        torch.ops.aten._scaled_dot_product_cudnn_attention(q, q, q, None, True)


def test_cudnn_refuses_what_its_aten_entry_cannot_run(kernel_of):
    """No window, softcap or ALiBi through aten's cuDNN entry: each refused by name, naming the
    kernel and the fix, before any call; causal q/k of different lengths is a window too."""
    kernel = kernel_of("cudnn")
    q = torch.randn(1, 2, 16, 8)
    cases = [(dict(window=(4, 0)), "window=(4, 0)"), (dict(softcap=30.0), "softcap=30.0"),
             (dict(alibi_slopes=torch.ones(2)), "ALiBi")]
    for kwargs, variant in cases:
        with pytest.raises(UnsupportedAttention, match=rf"{re.escape(variant)}.*cuDNN attention.*install flash-attn"):
            kernel.forward(q, q, q, True, None, **kwargs)
        with pytest.raises(UnsupportedAttention, match=rf"{re.escape(variant)}.*cuDNN attention"):
            kernel.backward(q, q, q, q, q, torch.zeros(1, 2, 16), True, None, **kwargs)
    assert kernel.calls == []
    causal, window = effective(True, NO_WINDOW, 8, 16)
    with pytest.raises(UnsupportedAttention, match="different lengths"):
        kernel.forward(q[:, :, :8], q, q, causal, None, window)
    assert kernel.variant_problems(NO_WINDOW, 0.0) == []


@pytest.mark.parametrize("name", ["flash-attn-3", "flash-attn-4"])
def test_flash_3_and_4_refuse_alibi(kernel_of, name):
    kernel = kernel_of(name)
    (problem,) = kernel.variant_problems(NO_WINDOW, 0.0, alibi=True)
    assert "ALiBi" in problem and name in problem and "flash-attn 2.5 to 2.8" in problem
    assert kernel.variant_problems((8, 0), 30.0) == []
    q = torch.randn(1, 2, 8, 8)
    with pytest.raises(UnsupportedAttention, match=f"ALiBi.*{name}"):
        kernel.forward(q, q, q, True, None, alibi_slopes=torch.ones(2))
    assert kernel.interface.calls == []


def test_a_parameter_the_installed_library_lacks_is_refused_not_dropped():
    """An FA4 whose backward has no softcap: softcap is refused by name (compile time and call),
    and a call never loses the argument."""
    interface = flash_attn_4_interface()
    real = interface._flash_attn_bwd

    def _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, window_size_left=None,
                        window_size_right=None, deterministic=False, dq=None, dk=None, dv=None):
        return real(q, k, v, out, dout, lse, softmax_scale, causal, 0.0, window_size_left, window_size_right,
                    deterministic=deterministic, dq=dq, dk=dk, dv=dv)

    interface._flash_attn_bwd = _flash_attn_bwd
    kernel = kernels.FlashAttn4Kernels(interface)
    (problem,) = kernel.variant_problems(NO_WINDOW, 30.0)
    assert "softcap=30.0" in problem and "_flash_attn_bwd" in problem and "_flash_attn_fwd" not in problem
    q = torch.randn(1, 2, 8, 8)
    out, lse = kernel.forward(q, q, q, True, None)  # no softcap: fine
    kernel.backward(q, q, q, q, out, lse, True, None)
    with pytest.raises(UnsupportedAttention, match="softcap"):
        kernel.backward(q, q, q, q, out, lse, True, None, NO_WINDOW, 30.0)


@pytest.mark.parametrize("name", ["flash-attn-3", "flash-attn-4"])
def test_backward_honours_deterministic_algorithms(kernel_of, name):
    kernel = kernel_of(name)
    q = torch.randn(1, 2, 16, 8)
    out, lse = kernel.forward(q, q, q, True, None)
    previous = torch.are_deterministic_algorithms_enabled()
    try:
        for deterministic in (True, False):
            torch.use_deterministic_algorithms(deterministic)
            kernel.backward(q, q, q, q, out, lse, True, None)
            assert kernel.interface.calls[-1]["deterministic"] is deterministic
    finally:
        torch.use_deterministic_algorithms(previous)


def test_cuda_variant_problems_ask_the_installed_kernel(kernel_of, monkeypatch):
    for name, refused in (("cudnn", {"window", "softcap", "ALiBi"}), ("flash-attn-3", {"ALiBi"}),
                          ("flash-attn-4", {"ALiBi"})):
        kernel = kernel_of(name)
        monkeypatch.setattr(kernels, "_cuda_kernels", lambda kernel=kernel: kernel)
        monkeypatch.setattr(kernels, "_installed", lambda name: None)  # no other kernel to fall back on
        for variant, args in (("window", ((128, 0), 0.0)), ("softcap", (NO_WINDOW, 30.0)),
                              ("ALiBi", (NO_WINDOW, 0.0, True))):
            problems = kernels.variant_problems("cuda", *args)
            assert bool(problems) is (variant in refused), (name, variant, problems)


# --- installed and picked ---------------------------------------------------------------------

@pytest.fixture
def device(monkeypatch):
    """``set(capability, fa3=, fa4=, cudnn=)``: pretend a GPU of that capability with those
    libraries; the registry's pick is recomputed."""

    def set_device(capability, fa3=False, fa4=False, cudnn_ok=False):
        monkeypatch.setattr(hopper_family, "cuda_capability", lambda: capability)
        for module, present, make in (("flash_attn_3.flash_attn_interface", fa3, flash_attn_3_interface),
                                      ("flash_attn.cute.interface", fa4, flash_attn_4_interface)):
            if present:
                monkeypatch.setitem(sys.modules, module, make())
            else:
                monkeypatch.setitem(sys.modules, module, None)  # an import of it fails
        monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: cudnn_ok)
        monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91000 if cudnn_ok else None)
        monkeypatch.setattr(kernels, "_first_use_check", lambda kernel: True)  # it needs a GPU: tested apart
        kernels._cuda_kernels.cache_clear()
        kernels._installed.cache_clear()
        return kernels.cuda_kernel().name

    yield set_device
    kernels._cuda_kernels.cache_clear()
    kernels._installed.cache_clear()


def test_registry_order_is_the_preference(device):
    assert list(kernels.CUDA_KERNELS) == ["flash-attn-3", "flash-attn-4", "cudnn", "flash-attn", "aten-flash"]
    assert kernels.DEFAULT_CUDA_KERNEL == "flash-attn"
    assert device((9, 0), fa3=True, fa4=True, cudnn_ok=True) == "flash-attn-3"
    assert device((9, 0), fa4=True, cudnn_ok=True) == "flash-attn-4"
    assert device((10, 0), fa3=True, fa4=True, cudnn_ok=True) == "flash-attn-4"  # FA3 is Hopper's only
    assert device((9, 0), cudnn_ok=True) == "cudnn"
    assert device((12, 0), fa4=True, cudnn_ok=True) == "cudnn"  # no FA4 backward contract on sm120 here
    assert device((9, 0)) == "aten-flash"  # no cuDNN >= 9, flash-attn not installed here
    assert device((8, 0), fa3=True, fa4=True, cudnn_ok=True) == "aten-flash"  # all need sm90+
    assert device(None, fa3=True, fa4=True, cudnn_ok=True) == "aten-flash"  # no GPU


def test_cudnn_is_skipped_where_disabled_or_strictly_deterministic(device, monkeypatch):
    assert device((9, 0), cudnn_ok=True) == "cudnn"
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: False)
    assert device((9, 0), cudnn_ok=True) == "aten-flash"
    monkeypatch.undo()
    previous = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        assert device((9, 0), cudnn_ok=True) == "aten-flash"
        torch.use_deterministic_algorithms(True, warn_only=True)
        assert device((9, 0), cudnn_ok=True) == "cudnn"
    finally:
        torch.use_deterministic_algorithms(previous)


def test_cudnn_adapter_matches_this_torchs_schemas():
    """The argument names and order the adapter passes are torch's (a rename turns cuDNN off
    rather than mis-calling it)."""
    assert cudnn._schemas_match()


def test_input_problems_name_the_limit(monkeypatch):
    monkeypatch.setattr(hopper_family, "cuda_capability", lambda: (9, 0))
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 90100)
    cudnn._head_dim_limit.cache_clear()
    try:
        assert kernels.CudnnKernels.input_problems(torch.bfloat16, 128) == []
        (wide,) = kernels.CudnnKernels.input_problems(torch.bfloat16, 192)
        assert "at most 128" in wide and "cuDNN" in wide
        (fp32,) = kernels.FlashAttn4Kernels.input_problems(torch.float32, 128)
        assert "fp16 or bf16" in fp32
        assert kernels.FlashAttn3Kernels.input_problems(torch.bfloat16, 256) == []
        assert "multiple of 8" in kernels.FlashAttn3Kernels.input_problems(torch.bfloat16, 100)[0]
    finally:
        cudnn._head_dim_limit.cache_clear()


# --- backward workspace -----------------------------------------------------------------------

def test_flash_3_and_4_backward_workspace():
    """FA3's mha_bwd / FA4's _flash_attn_bwd on Hopper, Llama3-8B's stage (1 q head, 1 KV head)
    and a GQA call: fp32 dQ accumulator and row sums, GQA's fp32 dK/dV accumulators."""
    seq = 2**20
    fa3 = kernels.FlashAttn3Kernels.backward_workspace(1, 1, 1, seq, 128, torch.bfloat16, False, H100_SMS)
    assert fa3 == {
        "softmax_d": ((1, 1, seq), torch.float32), "softmax_lse_log2": ((1, 1, seq), torch.float32),
        "dq_accum": ((1, 1, seq * 128), torch.float32), "dq_semaphore": ((seq // 64, 1, 1), torch.int32),
    }
    fa4 = kernels.FlashAttn4Kernels.backward_workspace(1, 4, 1, 1000, 128, torch.bfloat16, True, H100_SMS)
    assert fa4["dq_accum"] == ((1, 4, 1024 * 128), torch.float32)
    assert fa4["dk_accum"] == fa4["dv_accum"] == ((1, 1, 1024 * 128), torch.float32)
    assert {"dq_semaphore", "dk_semaphore", "dv_semaphore"} <= set(fa4)
    assert "dq_semaphore" not in kernels.FlashAttn4Kernels.backward_workspace(1, 4, 1, 1000, 128, torch.bfloat16,
                                                                              False, H100_SMS)
    # FA3 rounds head dims to its compiled ones; packed rows pad one tile per document
    assert kernels.FlashAttn3Kernels.backward_workspace(1, 2, 2, 1000, 80, torch.bfloat16, False, H100_SMS)[
        "dq_accum"] == ((1, 2, 1024 * 96), torch.float32)
    packed = kernels.FlashAttn3Kernels.backward_workspace(1, 2, 2, 1000, 128, torch.bfloat16, False, H100_SMS,
                                                          documents=3)
    assert packed["softmax_d"] == ((2, 1216), torch.float32)


def test_cudnn_backward_workspace_model():
    ws = kernels.CudnnKernels.backward_workspace(1, 4, 2, 1000, 128, torch.bfloat16, False, H100_SMS)
    assert ws == {
        "softmax_sum": ((1, 4, 1000), torch.float32), "dq_accum": ((1, 4, 1000, 128), torch.float32),
        "dk_expanded": ((1, 4, 1000, 128), torch.bfloat16), "dv_expanded": ((1, 4, 1000, 128), torch.bfloat16),
    }
    assert set(kernels.CudnnKernels.backward_workspace(1, 4, 4, 1000, 128, torch.bfloat16, False, H100_SMS)) == {
        "softmax_sum", "dq_accum"}


def test_cudnn_workspace_equals_the_h200_measurement():
    """The one allocation an H200 made in cuDNN's backward (benchmarks/results/gpu/
    gpu_rank_flagship_h200.md, Ulysses at 2M: 8.031 GiB for 4 query heads over 1 KV head)."""
    ws = kernels.CudnnKernels.backward_workspace(1, 4, 1, 2097152, 128, torch.bfloat16, False, H100_SMS)
    total = sum(math.prod(shape) * torch.empty(0, dtype=dtype).element_size() for shape, dtype in ws.values())
    assert total == 8.03125 * 2**30


def test_a_call_the_preferred_kernel_cannot_run_goes_to_the_next_installed():
    """cuDNN first (no window, no ALiBi), flash-attn 2 after it: a window runs on flash-attn
    rather than being refused; what no installed kernel takes is refused with the preferred one's reason."""
    from types import SimpleNamespace

    from upipe_compile.attention import kernels

    def kernel(name, window=True, alibi=True, softcap=True):
        def variant_problems(w, s, a=False):
            return ([f"{name}: no window"] if w != kernels.NO_WINDOW and not window else []) + (
                [f"{name}: no softcap"] if s and not softcap else []) + ([f"{name}: no ALiBi"] if a and not alibi else [])
        return SimpleNamespace(name=name, variant_problems=variant_problems, input_problems=lambda d, h: [])

    cudnn, fa2 = kernel("cudnn", window=False, alibi=False, softcap=False), kernel("flash-attn")
    aten = kernel("aten-flash", softcap=False, alibi=False)
    installed = {"cudnn": cudnn, "flash-attn": fa2, "aten-flash": aten}
    original = (kernels._cuda_kernels, kernels._installed)
    try:
        kernels._cuda_kernels, kernels._installed = (lambda: cudnn), installed.get
        assert kernels.variant_problems("cuda", window=(128, 0)) == []
        assert kernels._first_that(lambda k: k.variant_problems((128, 0), 0.0))[0] is fa2
        assert kernels._first_that(lambda k: k.variant_problems(kernels.NO_WINDOW, 0.0))[0] is cudnn
        installed["flash-attn"] = None  # not installed: a window goes to aten, softcap to nobody
        assert kernels._first_that(lambda k: k.variant_problems((128, 0), 0.0))[0] is aten
        assert kernels.variant_problems("cuda", softcap=30.0) == ["cudnn: no softcap"]  # the preferred one's reason
    finally:
        kernels._cuda_kernels, kernels._installed = original


def test_the_first_use_check_passes_a_right_kernel_and_catches_a_misread_lse():
    """The check a kernel not yet run on a GPU passes before its first use, run here with the
    CPU kernel (right) and with one whose log-sum-exp comes back in another layout, as a
    library's [B, H, S, 1] read as [B, S, H] would (wrong)."""
    from upipe_compile.attention import kernels

    right = kernels.CpuKernels()
    assert kernels._compare_with_float64(right, device="cpu") == ""

    class MisreadLse(kernels.CpuKernels):
        def forward(self, q, k, v, is_causal, scale, *args):
            out, lse = super().forward(q, k, v, is_causal, scale, *args)
            return out, lse.transpose(1, 2).reshape(lse.shape)

    assert "lse is off" in kernels._compare_with_float64(MisreadLse(), device="cpu")

    class WrongDv(kernels.CpuKernels):
        def backward(self, *args, **kwargs):
            dq, dk, dv = super().backward(*args, **kwargs)
            return dq, dk, dv * 1.5

    assert "dv is off" in kernels._compare_with_float64(WrongDv(), device="cpu")
