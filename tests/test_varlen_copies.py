"""A packed-sequence (varlen) backward makes no host-device traffic per call once the
boundaries are on the device: no tensor built from host data (a blocking
host-to-device copy on a GPU) and no read-back (``.tolist()``/``.item()``, a
device-to-host sync). Counted on CPU, where neither is a real copy, by the ops that would
be one: ``aten.lift_fresh`` (``torch.tensor``/``as_tensor`` of host values), a
``_to_copy``/``copy_`` from the CPU to another device, ``_local_scalar_dense`` and
``Tensor.tolist``. The kernel is flash-attn's adapter over a CPU stand-in of its varlen
interface (what CUDA runs); the stand-in's own checks read the boundaries back, so the
count pauses inside it. The first call may read and cache; the second is counted."""

from __future__ import annotations

import pytest
import torch
from flash_attn_standins import FAMILIES
from torch._library.custom_ops import OPDEFS
from torch.utils._python_dispatch import TorchDispatchMode

import upipe_compile
from upipe_compile.attention import kernels
from upipe_compile.measure import workspace
from upipe_compile.attention.document_boundaries import Documents

_aten = torch.ops.aten
LENGTHS = (8, 16, 8, 24, 8, 16, 8, 40)  # short documents: the backward runs several varlen groups


def _host_to_device(func, args, kwargs) -> bool:
    if func is _aten.lift_fresh.default:  # torch.tensor / as_tensor of host values
        return True
    if func is _aten._to_copy.default:
        source, target = args[0], kwargs.get("device")
    elif func is _aten.copy_.default:
        source, target = args[1], args[0].device
    else:
        return False
    return source.device.type == "cpu" and target is not None and torch.device(target).type != "cpu"


class HostTraffic(TorchDispatchMode):
    """Counts host->device tensor creations (``h2d``) and device->host read-backs (``d2h``)."""

    def __init__(self):
        super().__init__()
        self.h2d, self.d2h, self.paused = [], [], False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.paused and _host_to_device(func, args, kwargs):
            self.h2d.append(str(func))
        if not self.paused and func is _aten._local_scalar_dense.default:  # .item(), int(), bool()
            self.d2h.append(str(func))
        if func.namespace == "upipe":  # a mode sees none of a custom op's inner ops: run its body counted
            with self:
                return OPDEFS[func._schema.name]._init_fn(*args, **kwargs)
        return func(*args, **kwargs)


class PausedKernel(kernels.FlashAttnKernels):
    """The flash-attn adapter, not counting inside the stand-in's varlen functions."""

    counter: HostTraffic | None = None

    def _run(self, *args, **kwargs):
        paused = self.counter.paused if self.counter else False
        if self.counter:
            self.counter.paused = True
        try:
            return super()._run(*args, **kwargs)
        finally:
            if self.counter:
                self.counter.paused = paused


@pytest.fixture(params=sorted(FAMILIES))
def varlen_kernel(request, monkeypatch):
    """CPU tensors run through flash-attn's adapter over the stand-in of one release."""
    kernel = PausedKernel(FAMILIES[request.param]())
    monkeypatch.setattr(kernels, "_CPU", kernel)
    return kernel


def _inputs(batch=2, q_heads=4, kv_heads=2, dim=8, seed=0):
    seq = sum(LENGTHS)
    gen = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(batch, q_heads, seq, dim, generator=gen) for _ in range(2))
    k, v = (torch.randn(batch, kv_heads, seq, dim, generator=gen) for _ in range(2))
    return q, k, v, dout


def _counted(kernel, call):
    """``call()`` and the host traffic it made outside the stand-in's varlen functions."""
    kernel.counter = counter = HostTraffic()
    tolist = torch.Tensor.tolist

    def counted_tolist(tensor):
        if not counter.paused:
            counter.d2h.append("tolist")
        return tolist(tensor)

    torch.Tensor.tolist = counted_tolist
    try:
        with counter:
            result = call()
    finally:
        kernel.counter = None
        torch.Tensor.tolist = tolist
    return result, counter


def test_varlen_backward_makes_no_host_copies_per_call(varlen_kernel):
    """The stage loop's kernel call: documents already checked and on the device."""
    bounds = [0, *torch.tensor(LENGTHS).cumsum(0).tolist()]
    documents = Documents.from_bounds(bounds, torch.device("cpu"))
    q, k, v, dout = _inputs()
    out, lse = kernels.forward(q, k, v, True, None, documents)
    assert len(workspace.varlen_backward_groups(documents, q.shape[1], False)) > 1
    first = kernels.backward(dout, q, k, v, out, lse, True, None, documents)
    second, counter = _counted(varlen_kernel, lambda: kernels.backward(dout, q, k, v, out, lse, True, None, documents))
    assert (counter.h2d, counter.d2h) == ([], [])
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("as_positions", [False, True])
def test_document_sdpa_step_makes_no_host_copies_after_the_first(varlen_kernel, as_positions):
    """document_sdpa on one process: every layer of a step passes the same boundaries
    tensor, so only the first forward reads it back and copies it to the device."""
    q, k, v, dout = _inputs(batch=1)
    if as_positions:
        boundaries = torch.cat([torch.arange(n) for n in LENGTHS]).unsqueeze(0)
    else:
        boundaries = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])

    def layer():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = upipe_compile.document_sdpa(*leaves, boundaries, is_causal=True, enable_gqa=True)
        out.backward(dout)
        return [out.detach(), *(t.grad for t in leaves)]

    first = layer()
    second, counter = _counted(varlen_kernel, layer)
    assert (counter.h2d, counter.d2h) == ([], [])
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
