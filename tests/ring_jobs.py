"""Rank-side jobs for tests/test_ring.py (module-level so spawn can pickle them)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests_support import AttentionCase, make_inputs
from upipe_compile.attention.ring import ring_backward, ring_forward
from upipe_compile.attention.zigzag import zigzag_shard


def ring_case(case: AttentionCase, window=(-1, -1), softcap: float = 0.0, bounds=None):
    """Ring attention of this rank's zigzag share over the whole world as the ring:
    (out, lse, dq, dk, dv) shares. ``bounds``: packed documents over the whole sequence."""
    from upipe_compile.attention.document_boundaries import Documents

    rank, ring = dist.get_rank(), dist.get_world_size()
    documents = None if bounds is None else Documents.from_bounds(bounds, torch.device("cpu"))
    q, k, v, dout = (zigzag_shard(x, rank, ring, dim=2) for x in make_inputs(case))
    out, lse = ring_forward(q, k, v, case.is_causal, case.scale, dist.group.WORLD, softcap, window, documents)
    dq, dk, dv = ring_backward(dout, q, k, v, out, lse, case.is_causal, case.scale, dist.group.WORLD, softcap,
                               window, documents)
    return out, lse, dq, dk, dv


def odd_share_case():
    q = torch.zeros(1, 2, 3, 8)
    return ring_forward(q, q, q, True, None, dist.group.WORLD)


def hybrid_case(case: AttentionCase, ring: int):
    """upipe_attention over a (ring, all-to-all) mesh of the world: this rank's shard as
    shard_sequence lays it out; returns (out, dq, dk, dv) shards and the shard's positions."""
    from torch.distributed.device_mesh import init_device_mesh

    import upipe_compile

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (ring, world // ring), mesh_dim_names=("cp_ring", "cp_a2a"))
    q, k, v, dout = (upipe_compile.shard_sequence(x, mesh, dim=2).clone() for x in make_inputs(case))
    for x in (q, k, v):
        x.requires_grad_(True)
    out = upipe_compile.upipe_attention(q, k, v, is_causal=case.is_causal, scale=case.scale, enable_gqa=True,
                                        cp_mesh=mesh, heads_per_stage=case.heads_per_stage, prefetch=case.prefetch)
    out.backward(dout)
    positions = upipe_compile.global_positions(q.shape[2], mesh)
    gathered = upipe_compile.gather_sequence(out.detach(), mesh, dim=2)
    return out.detach(), q.grad, k.grad, v.grad, positions, gathered


def hybrid_refusals():
    """The messages of what a ring x all-to-all mesh refuses, on this rank."""
    from torch.distributed.device_mesh import init_device_mesh

    import upipe_compile

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp_ring", "cp_a2a"))
    wrong = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    q = torch.randn(1, 4, 4, 8)
    attempts = {
        "names": lambda: upipe_compile.upipe_attention(q, q, q, cp_mesh=wrong),
        "uneven": lambda: upipe_compile.shard_sequence(torch.zeros(1, 12), mesh, dim=1),
    }
    messages = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            messages[name] = None
        except Exception as error:  # noqa: BLE001  (the test reads the message)
            messages[name] = f"{type(error).__name__}: {error}"
    return messages


def compiled_hybrid_case(case: AttentionCase, ring: int, inner_backend: str):
    """TinyAttention compiled with backend="upipe" over a (ring, all-to-all) mesh, on this
    rank's shard as shard_sequence lays it out: (out, dx, param grads)."""
    from torch.distributed.device_mesh import init_device_mesh

    import upipe_compile
    from tests_support import TinyAttention, block_grads, make_block_inputs

    torch._dynamo.reset()
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (ring, world // ring), mesh_dim_names=("cp_ring", "cp_a2a"))
    x, dout = (upipe_compile.shard_sequence(t, mesh, dim=1) for t in make_block_inputs(case))
    model = torch.compile(TinyAttention(case), backend="upipe",
                          options={"cp_mesh": mesh, "heads_per_stage": case.heads_per_stage,
                                   "prefetch": case.prefetch, "inner_backend": inner_backend})
    return block_grads(model, x, dout)


class TinyRopeAttention(torch.nn.Module):
    """A Llama-like attention layer: q/k/v/o projections, GQA, RoPE from the position ids the
    caller passes (``global_positions`` under context parallelism), SDPA."""

    def __init__(self, case: AttentionCase, theta: float = 10000.0):
        from tests_support import TinyAttention

        super().__init__()
        self.case = case
        self.layer = TinyAttention(case)  # its wq, wk, wv, wo (same seeds on every process)
        dim = case.head_dim
        inv_freq = theta ** -(torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @staticmethod
    def rotate(t, cos, sin):
        half = t.shape[-1] // 2
        return t * cos + torch.cat((-t[..., half:], t[..., :half]), dim=-1) * sin

    def forward(self, x, positions):
        b, s, _ = x.shape
        c, layer = self.case, self.layer
        freqs = positions[..., None].float() * self.inv_freq  # [1, s, D/2]
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos().to(x.dtype).unsqueeze(1), angles.sin().to(x.dtype).unsqueeze(1)  # [1, 1, s, D]
        q = self.rotate(layer.wq(x).view(b, s, c.q_heads, c.head_dim).transpose(1, 2), cos, sin)
        k = self.rotate(layer.wk(x).view(b, s, c.kv_heads, c.head_dim).transpose(1, 2), cos, sin)
        v = layer.wv(x).view(b, s, c.kv_heads, c.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=c.is_causal, scale=c.scale, enable_gqa=True)
        return layer.wo(out.transpose(1, 2).reshape(b, s, -1))


def rope_block_grads(model, x, dout, positions):
    """(out, dx, param grads by name) of one forward + backward of a TinyRopeAttention."""
    x = x.detach().clone().requires_grad_(True)
    out = model(x, positions)
    out.backward(dout)
    module = getattr(model, "_orig_mod", model)
    return out.detach(), x.grad, {name: p.grad for name, p in module.named_parameters()}


def _ring_mesh(ring: int):
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    return init_device_mesh("cpu", (ring, world // ring), mesh_dim_names=("cp_ring", "cp_a2a"))


def _compiled_recording(module: torch.nn.Module, options) -> tuple[torch.nn.Module, list[str]]:
    """``module`` compiled by the upipe passes with ``options`` (then aot_eager), and the list
    the upipe ops left in its graphs are recorded into as it compiles."""
    from upipe_compile.backend import apply_upipe_passes, inner_backend

    torch._dynamo.reset()
    seen = []

    def backend(gm, example_inputs):
        gm = apply_upipe_passes(gm, options)
        seen.extend(str(n.target) for m in gm.modules() if isinstance(m, torch.fx.GraphModule)
                    for n in m.graph.nodes if str(n.target).startswith("upipe."))
        return inner_backend("aot_eager")(gm, example_inputs)

    return torch.compile(module, backend=backend), seen


def compiled_fused_ring_case(case: AttentionCase, ring: int, recompute: bool):
    """TinyRopeAttention compiled with backend="upipe" (aot_eager) over a (ring, all-to-all)
    mesh, on this rank's shard with its global positions: (out, dx, param grads, the upipe
    ops the rewritten graph holds)."""
    import upipe_compile
    from tests_support import make_block_inputs
    from upipe_compile.options import UPipeOptions

    mesh = _ring_mesh(ring)
    x, dout = (upipe_compile.shard_sequence(t, mesh, dim=1) for t in make_block_inputs(case))
    positions = upipe_compile.global_positions(x.shape[1], mesh)
    options = UPipeOptions(cp_mesh=mesh, heads_per_stage=case.heads_per_stage, prefetch=case.prefetch,
                           inner_backend="aot_eager", recompute_attention_output=recompute)
    model, seen = _compiled_recording(TinyRopeAttention(case), options)
    return (*rope_block_grads(model, x, dout, positions), sorted(set(seen)))


def compiled_variant_ring_case(case: AttentionCase, ring: int, window, softcap, with_sinks: bool, fuse: bool):
    """TinyVariantAttention (a window, softcap and/or sinks) compiled with backend="upipe" (aot_eager)
    over a (ring, all-to-all) mesh, on this rank's shard: (out, dx, param grads, the upipe ops
    the rewritten graph holds)."""
    import upipe_compile
    from tests_support import TinyVariantAttention, block_grads, make_block_inputs
    from upipe_compile.options import UPipeOptions

    mesh = _ring_mesh(ring)
    x, dout = (upipe_compile.shard_sequence(t, mesh, dim=1) for t in make_block_inputs(case))
    options = UPipeOptions(cp_mesh=mesh, heads_per_stage=case.heads_per_stage, prefetch=case.prefetch,
                           inner_backend="aot_eager", fuse_projections=fuse)
    model, seen = _compiled_recording(TinyVariantAttention(case, window, softcap, with_sinks), options)
    return (*block_grads(model, x, dout), sorted(set(seen)))
