"""Jobs that run on every rank of a RankPool (module-level so spawn can pickle them)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import upipe_compile
from tests_support import AttentionCase, make_inputs


def op_case(case: AttentionCase, cu_seqlens: torch.Tensor | None = None):
    """upipe_attention on this rank's shard; returns (out, dq, dk, dv) shards."""
    rank, world = dist.get_rank(), dist.get_world_size()
    q, k, v, dout = (x.chunk(world, dim=2)[rank].clone() for x in make_inputs(case))
    for x in (q, k, v):
        x.requires_grad_(True)
    out = upipe_compile.upipe_attention(
        q, k, v, is_causal=case.is_causal, scale=case.scale, enable_gqa=True, heads_per_stage=case.heads_per_stage,
        prefetch=case.prefetch, cu_seqlens=cu_seqlens,
    )
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def compiled_block_case(case: AttentionCase, inner_backend: str):
    """TinyAttention compiled with backend="upipe" on this rank's shard: (out, dx, param grads)."""
    from tests_support import TinyAttention, block_grads, make_block_inputs

    torch._dynamo.reset()
    rank, world = dist.get_rank(), dist.get_world_size()
    x, dout = (t.chunk(world, dim=1)[rank] for t in make_block_inputs(case))
    model = torch.compile(
        TinyAttention(case), backend="upipe",
        options={"heads_per_stage": case.heads_per_stage, "prefetch": case.prefetch, "inner_backend": inner_backend},
    )
    return block_grads(model, x, dout)


def uneven_shards_case():
    rank = dist.get_rank()
    q = torch.randn(1, 4, 3 + rank, 8)
    return upipe_compile.upipe_attention(q, q, q, is_causal=True)


def op_case_with_flash_standin(case: AttentionCase, family: str, bounds: tuple[int, ...] | None = None):
    """op_case (packed_op_case with ``bounds``) with the stage loop's kernels replaced by
    FlashAttnKernels over a CPU stand-in of flash-attn's interface (what the CUDA path runs)."""
    from flash_attn_standins import FAMILIES

    from upipe_compile.attention import kernels

    cpu, interface = kernels._CPU, FAMILIES[family]()
    kernels._CPU = kernels.FlashAttnKernels(interface)
    try:
        result = op_case(case) if bounds is None else packed_op_case(case, bounds)
    finally:
        kernels._CPU = cpu
    assert interface.calls, "the stage loop did not go through the flash-attn adapter"
    if bounds is not None and len(bounds) > 2:
        assert all(call.get("varlen") for call in interface.calls), "packed stages must use the varlen kernels"
    return result


def shard_lengths_in_turn(path, lengths_by_rank: list[list[int]], dynamic: bool | None = False):
    """Call ``path`` ("op": upipe_attention; "fused" / "unfused": a compiled TinyAttention
    with or without fused projections) once per step with this rank's local length
    ``lengths_by_rank[rank][step]``; per step "ok" or the error. A compiled graph is reused
    on a rank whose length it has seen, and the shape check must still run there.
    ``dynamic``: torch.compile's (None: a rank recompiles with a dynamic length, unfused, on
    its first new length, so ranks can end up running different graphs)."""
    from tests_support import AttentionCase, TinyAttention

    rank = dist.get_rank()
    path = path if isinstance(path, str) else path[rank]  # one path per rank
    model = None
    if path != "op":
        torch._dynamo.reset()
        case = AttentionCase(world=dist.get_world_size(), batch=1, q_heads=4, kv_heads=2, seq_local=4, head_dim=8,
                             heads_per_stage=None, is_causal=True, scale=None, dtype="float32", seed=0)
        model = torch.compile(TinyAttention(case), backend="upipe",
                              options={"fuse_projections": path == "fused"}, dynamic=dynamic)
    outcomes = []
    for seq_local in lengths_by_rank[rank]:
        try:
            if model is None:
                q = torch.randn(1, 4, seq_local, 8, requires_grad=True)
                upipe_compile.upipe_attention(q, q, q, is_causal=True).sum().backward()
            else:
                model(torch.randn(1, seq_local, 32, requires_grad=True)).sum().backward()
            outcomes.append("ok")
        except upipe_compile.UnsupportedAttention as error:
            outcomes.append(str(error))
    return outcomes


def shape_check_tensors():
    """The devices of the tensors the shape check all-gathers, and whether a gloo group is
    its own host group."""
    from upipe_compile.attention import collectives

    devices, real = set(), dist.all_gather

    def recording(outs, inp, *args, **kwargs):
        devices.update({inp.device.type, *(out.device.type for out in outs)})
        return real(outs, inp, *args, **kwargs)

    dist.all_gather = recording
    try:
        collectives.check_same_local_shape((1, 4, 2, 5, 8), dist.group.WORLD)
    finally:
        dist.all_gather = real
    return devices, collectives.host_group(dist.group.WORLD) is dist.group.WORLD


def packed_op_case(case: AttentionCase, bounds: tuple[int, ...], dtype: str = "int32"):
    """op_case over a packed sequence: ``bounds`` are the documents' cumulative lengths
    over the full sequence, passed identically on every rank."""
    return op_case(case, torch.tensor(bounds, dtype=getattr(torch, dtype)))


def packed_bad_boundaries_case(bounds_per_rank: list, dtype: str = "int32"):
    """upipe_attention with rank r passing ``bounds_per_rank[r]``: expected to raise on every rank."""
    rank = dist.get_rank()
    q = torch.randn(1, 2, 4, 8)
    cu_seqlens = torch.tensor(bounds_per_rank[rank], dtype=getattr(torch, dtype))
    try:
        upipe_compile.upipe_attention(q, q, q, is_causal=True, cu_seqlens=cu_seqlens)
    except upipe_compile.UnsupportedAttention as error:
        return str(error)
    return None


class _DocumentAttention(torch.nn.Module):
    """TinyAttention with document_sdpa instead of SDPA (what a packing model calls)."""

    def __init__(self, case: AttentionCase):
        super().__init__()
        from tests_support import TinyAttention

        self.inner = TinyAttention(case)

    def forward(self, x, cu_seqlens):
        inner, c = self.inner, self.inner.case
        b, s, _ = x.shape
        q = inner.wq(x).view(b, s, c.q_heads, c.head_dim).transpose(1, 2)
        k = inner.wk(x).view(b, s, c.kv_heads, c.head_dim).transpose(1, 2)
        v = inner.wv(x).view(b, s, c.kv_heads, c.head_dim).transpose(1, 2)
        out = upipe_compile.document_sdpa(q, k, v, cu_seqlens, is_causal=c.is_causal, scale=c.scale, enable_gqa=True)
        return inner.wo(out.transpose(1, 2).reshape(b, s, -1))


def compiled_document_block_case(case: AttentionCase, bounds: tuple[int, ...], inner_backend: str):
    """The document_sdpa block compiled with backend="upipe" on this rank's shard, with the
    full-sequence boundaries: (out, dx, param grads, how many boundary checks ran)."""
    from tests_support import make_block_inputs

    torch._dynamo.reset()
    rank, world = dist.get_rank(), dist.get_world_size()
    x, dout = (t.chunk(world, dim=1)[rank] for t in make_block_inputs(case))
    model = _DocumentAttention(case)
    compiled = torch.compile(model, backend="upipe", options={"heads_per_stage": case.heads_per_stage,
                                                              "inner_backend": inner_backend})
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32)
    x = x.detach().clone().requires_grad_(True)
    out = compiled(x, cu_seqlens)
    out.backward(dout)
    return out.detach(), x.grad, {name: p.grad for name, p in model.inner.named_parameters()}


def document_block_reference(case: AttentionCase, bounds: tuple[int, ...]):
    """The same block on one process, uncompiled: document_sdpa over the full sequence."""
    from tests_support import block_grads, make_block_inputs

    x, dout = make_block_inputs(case)
    model = _DocumentAttention(case)
    x = x.detach().clone().requires_grad_(True)
    out = model(x, torch.tensor(bounds))
    out.backward(dout)
    return out.detach(), x.grad, {name: p.grad for name, p in model.inner.named_parameters()}


def boundary_checks_per_call(bounds: tuple[int, ...], calls: int, modify_between: bool):
    """``calls`` op calls sharing one boundaries tensor (as a model's layers do): how many
    cross-rank boundary checks (all-gathers beyond the once-per-shape check) each made."""
    from upipe_compile.attention import collectives

    q = torch.randn(1, 2, bounds[-1] // dist.get_world_size(), 8)
    upipe_compile.upipe_attention(q, q, q, is_causal=True)  # the shape check, once
    cu_seqlens = torch.tensor(bounds, dtype=torch.int64)
    gathers, real = [], collectives.all_gather
    collectives.all_gather = lambda *a, **k: gathers.append(1) or real(*a, **k)
    counts = []
    try:
        for _ in range(calls):
            before = len(gathers)
            upipe_compile.upipe_attention(q, q, q, is_causal=True, cu_seqlens=cu_seqlens)
            counts.append(len(gathers) - before)
            if modify_between:
                cu_seqlens.add_(0)  # an in-place change: the boundaries must be checked again
    finally:
        collectives.all_gather = real
    return counts


def boundaries_fresh_on_rank_1(bounds: tuple[int, ...], second_bounds: tuple[int, ...]):
    """Two op calls; rank 0 passes one boundaries tensor both times (its check is remembered),
    rank 1 a new tensor of ``second_bounds`` the second time: per call the count of
    boundary all-gathers, or the error."""
    from upipe_compile.attention import collectives

    q = torch.randn(1, 2, bounds[-1] // dist.get_world_size(), 8)
    first = torch.tensor(bounds, dtype=torch.int64)
    second = first if dist.get_rank() == 0 else torch.tensor(second_bounds, dtype=torch.int64)
    gathers, real = [], collectives.all_gather
    collectives.all_gather = lambda *a, **k: gathers.append(1) or real(*a, **k)
    outcomes = []
    try:
        for cu_seqlens in (first, second):
            before = len(gathers)
            try:
                upipe_compile.upipe_attention(q, q, q, is_causal=True, cu_seqlens=cu_seqlens)
                outcomes.append(len(gathers) - before)
            except upipe_compile.UnsupportedAttention as error:
                outcomes.append(str(error))
    finally:
        collectives.all_gather = real
    return outcomes


def variant_op_case(case: AttentionCase, window, softcap, with_sinks: bool, bounds=None):
    """upipe_attention with a window / softcap / sinks (and documents) on this rank's shard:
    (out, dq, dk, dv, dsinks) shards; dsinks is this rank's share (None without sinks)."""
    from tests_support import make_sinks

    rank, world = dist.get_rank(), dist.get_world_size()
    q, k, v, dout = (x.chunk(world, dim=2)[rank].clone() for x in make_inputs(case))
    sinks = make_sinks(case).requires_grad_(True) if with_sinks else None
    for x in (q, k, v):
        x.requires_grad_(True)
    out = upipe_compile.upipe_attention(
        q, k, v, is_causal=case.is_causal, scale=case.scale, enable_gqa=True, heads_per_stage=case.heads_per_stage,
        prefetch=case.prefetch, cu_seqlens=None if bounds is None else torch.tensor(bounds, dtype=torch.int32),
        window=window, softcap=softcap, sinks=sinks,
    )
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad, None if sinks is None else sinks.grad


def compiled_variant_block_case(case: AttentionCase, window, softcap, with_sinks: bool, fuse: bool,
                                inner_backend: str = "aot_eager", recompute: bool = False):
    """TinyVariantAttention compiled with backend="upipe" on this rank's shard: (out, dx,
    param grads, which upipe ops the graph holds)."""
    from tests_support import TinyVariantAttention, block_grads, make_block_inputs

    torch._dynamo.reset()
    rank, world = dist.get_rank(), dist.get_world_size()
    x, dout = (t.chunk(world, dim=1)[rank] for t in make_block_inputs(case))
    seen = []

    def recording(gm, example_inputs):
        seen.extend(str(n.target) for m in gm.modules() if isinstance(m, torch.fx.GraphModule)
                    for n in m.graph.nodes if str(n.target).startswith("upipe."))
        return gm.forward

    from upipe_compile.backend import apply_upipe_passes
    from upipe_compile.options import UPipeOptions

    options = UPipeOptions(heads_per_stage=case.heads_per_stage, prefetch=case.prefetch, fuse_projections=fuse,
                           inner_backend=inner_backend, recompute_attention_output=recompute)

    def backend(gm, example_inputs):
        gm = apply_upipe_passes(gm, options)
        recording(gm, example_inputs)
        from upipe_compile.backend import inner_backend as compiler_for

        return compiler_for(inner_backend)(gm, example_inputs)

    model = torch.compile(TinyVariantAttention(case, window, softcap, with_sinks), backend=backend)
    out, dx, grads = block_grads(model, x, dout)
    return out, dx, grads, sorted(set(seen))


def variant_op_case_with_flash_standin(case: AttentionCase, family: str, window, softcap, with_sinks: bool):
    """variant_op_case with the stage loop's kernels replaced by FlashAttnKernels over a CPU
    stand-in of that flash-attn release's interface (the CUDA path's argument routing)."""
    from flash_attn_standins import FAMILIES

    from upipe_compile.attention import kernels

    cpu, interface = kernels._CPU, FAMILIES[family]()
    kernels._CPU = kernels.FlashAttnKernels(interface)
    try:
        result = variant_op_case(case, window, softcap, with_sinks)
    finally:
        kernels._CPU = cpu
    assert interface.calls, "the stage loop did not go through the flash-attn adapter"
    return result
