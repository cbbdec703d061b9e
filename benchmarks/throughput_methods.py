"""The methods the throughput benchmark compares, by name, and how each runs one step.

Every method knows how to build a step for the two cases: the attention op alone and the
decoder block. A step runs forward + backward once and returns ``(seconds, results)``:
``results`` is ``None`` unless ``check=True``, then it is what gets compared with our
Ulysses (this rank's output shard and gradients). Methods that may not run here (DeepSpeed
not installed, torch's ring CP on CPU) say why through :func:`unavailable_reasons`, and
the table shows that reason instead of a number.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

import upipe_compile
from benchmarks import deepspeed_ulysses
from benchmarks.tiny_llama import Block, LlamaConfig

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}

# (check=False) -> (seconds, results for the check or None)
Step = Callable[..., tuple]


def squared_norms(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """[|actual - expected|^2, |expected|^2] of this rank's part (float32 temporaries of the
    local size only: the check must fit next to a long sequence)."""
    expected = expected.float()
    return torch.stack([(actual.float() - expected).pow(2).sum(), expected.pow(2).sum()]).double()


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


class Rank:
    """What every step needs on this rank: its mesh and group, device, dtype, options."""

    def __init__(self, device: torch.device, args, cfg: LlamaConfig):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device, self.args, self.cfg = device, args, cfg
        self.dtype = DTYPES[args.dtype]
        self.mesh = torch.distributed.device_mesh.init_device_mesh(device.type, (self.world,), mesh_dim_names=("cp",))
        self.group = self.mesh.get_group()

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def timed(self, fn):
        """Run ``fn`` after a barrier; its wall time on this rank and its result."""
        self.sync()
        dist.barrier()
        start = time.perf_counter()
        result = fn()
        self.sync()
        return time.perf_counter() - start, result

    def all_max(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def all_agree(self, ok: bool) -> bool:
        t = torch.tensor([0.0 if ok else 1.0], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item() == 0.0

    def gather_seq(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return upipe_compile.gather_sequence(t.contiguous(), self.mesh, dim=dim)

    def my_shard(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's contiguous shard of a full-sequence tensor."""
        local = full.shape[dim] // self.world
        return full.narrow(dim, self.rank * local, local)

    def relative_error(self, results, reference) -> float:
        """max over tensors of |a - e| / |e| over the whole sequence, from every rank's
        shard (replicated tensors, such as all-reduced weight gradients, give the same ratio)."""
        norms = torch.stack([squared_norms(a, e) for a, e in zip(results, reference)]).to(self.device)
        dist.all_reduce(norms)
        return (norms[:, 0] / norms[:, 1].clamp_min(1e-30)).sqrt().max().item()


# --- inputs of one (case, length) cell, shared by every method ----------------------------
@dataclass
class OpInputs:
    """This rank's q, k, v, dout shards, in DeepSpeed's [B, S/P, H, D] and our [B, H, S/P, D]
    layout (the same values, each contiguous)."""
    bshd: list
    bhsd: list


def op_inputs(r: Rank, seq: int) -> OpInputs:
    cfg = r.cfg
    gen = torch.Generator().manual_seed(1000 + r.rank)  # this rank's shard of one global tensor

    def make(heads):
        return torch.randn(1, seq // r.world, heads, cfg.head_dim, generator=gen).to(r.device, r.dtype)

    bshd = [make(cfg.q_heads), make(cfg.kv_heads), make(cfg.kv_heads), make(cfg.q_heads)]
    return OpInputs(bshd, [t.transpose(1, 2).contiguous() for t in bshd])


@dataclass
class BlockInputs:
    state: dict  # the block's weights, the same for every method
    x: torch.Tensor
    dy: torch.Tensor
    positions: torch.Tensor


def block_inputs(r: Rank, seq: int, seed: int = 2000) -> BlockInputs:
    s_local = seq // r.world
    torch.manual_seed(0)
    state = {k: v.to(r.dtype) for k, v in Block(r.cfg).state_dict().items()}
    gen = torch.Generator().manual_seed(seed + r.rank)
    x = torch.randn(1, s_local, r.cfg.hidden, generator=gen).to(r.device, r.dtype)
    dy = torch.randn(1, s_local, r.cfg.hidden, generator=gen).to(r.device, r.dtype)
    return BlockInputs(state, x, dy, upipe_compile.global_positions(s_local, r.mesh, device=r.device))


def load_block(r: Rank, model, inputs: BlockInputs):
    model.load_state_dict(inputs.state)
    return model.to(r.device, r.dtype)


# --- steps --------------------------------------------------------------------------------
def attention_step(r: Rank, tensors: list, attend, layout: str) -> Step:
    """forward + backward of ``attend(q, k, v)`` on this rank's shards; the check gets
    (out, dq, dk, dv) as [B, H, S/P, D]."""
    q, k, v = (t.clone().requires_grad_() for t in tensors[:3])
    dout = tensors[3]

    def step(check=False):
        for t in (q, k, v):
            t.grad = None

        def run():
            out = attend(q, k, v)
            out.backward(dout)
            return out.detach()

        seconds, out = r.timed(run)
        if not check:
            return seconds, None
        results = (out, q.grad, k.grad, v.grad)
        return seconds, tuple(t.transpose(1, 2) for t in results) if layout == "bshd" else results

    return step


def block_summary(model, y, dx):
    """(y, dx) of this rank's shard and the parameter gradients summed over ranks."""
    grads = []
    for _, p in sorted(model.named_parameters()):
        g = p.grad.detach().clone()
        dist.all_reduce(g)
        grads.append(g)
    return (y, dx, *grads)


def block_step(r: Rank, model, compiled, inputs: BlockInputs) -> Step:
    """forward + backward of a compiled block on this rank's shard."""
    x = inputs.x.clone().requires_grad_()

    def step(check=False):
        model.zero_grad(set_to_none=True)
        x.grad = None

        def run():
            y = compiled(x, inputs.positions)
            y.backward(inputs.dy)
            return y.detach()

        seconds, y = r.timed(run)
        return seconds, block_summary(model, y, x.grad) if check else None

    return step


def ring_attention_step(r: Rank, full: list[torch.Tensor], gqa: bool):
    """One forward + backward of SDPA under ``context_parallel`` (which shards the full
    [B, H, S, D] q, k, v, dout itself, head-tail load balanced). Timed inside the context
    only. Returns (seconds, (out, dq, dk, dv) over the full sequence in natural order)."""
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard

    buffers = [t.clone() for t in full]
    with context_parallel(r.mesh, buffers=buffers, buffer_seq_dims=[2] * 4, no_restore_buffers=set(buffers)):
        q, k, v = (b.detach().requires_grad_() for b in buffers[:3])

        def step():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
            out.backward(buffers[3])
            return out.detach()

        seconds, out = r.timed(step)
    results = context_parallel_unshard(r.mesh, [out, q.grad, k.grad, v.grad], [2] * 4)
    return seconds, tuple(results)


def ring_block_step(r: Rank, inputs: BlockInputs) -> Step:
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard

    model = load_block(r, Block(r.cfg), inputs)
    compiled = torch.compile(model, backend=r.args.inner_backend, dynamic=False)
    full = [r.gather_seq(inputs.x, 1), r.gather_seq(inputs.positions, 1), r.gather_seq(inputs.dy, 1)]

    def step(check=False):
        model.zero_grad(set_to_none=True)
        buffers = [t.clone() for t in full]
        with context_parallel(r.mesh, buffers=buffers, buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(buffers)):
            x = buffers[0].detach().requires_grad_()

            def run():
                y = compiled(x, buffers[1])
                y.backward(buffers[2])
                return y.detach()

            seconds, y = r.timed(run)
        if not check:
            return seconds, None
        y_full, dx_full = context_parallel_unshard(r.mesh, [y, x.grad], [1, 1])
        return seconds, block_summary(model, r.my_shard(y_full, 1), r.my_shard(dx_full, 1))

    return step


def ring_op_step(r: Rank, inputs: OpInputs) -> Step:
    full = [r.gather_seq(t, dim=2) for t in inputs.bhsd]

    def step(check=False):
        seconds, results = ring_attention_step(r, full, gqa=True)
        return seconds, tuple(r.my_shard(t, 2) for t in results) if check else None

    return step


# --- the registry -------------------------------------------------------------------------
@dataclass(frozen=True)
class Method:
    name: str
    heads_per_stage: Callable[[int, int], int]  # (query heads, P) -> U shown in the table
    op: Callable[[Rank, OpInputs, int], Step]  # (rank, inputs, U) -> step
    block: Callable[[Rank, BlockInputs, int], Step]
    ours: bool = False  # upipe_compile itself: must run; a peer that fails is reported instead
    profiled: bool = True  # included in the per-step profile
    default: bool = True  # runs without --methods


def upipe(name: str, heads_per_stage: Callable[[int, int], int], prefetch: str, fuse: bool = True,
          recompute_output: bool = False) -> Method:
    """upipe_compile with U = heads_per_stage(Hq, P), a prefetch mode, and (block case) the
    attention block fused into the stage loop or not (``fuse_projections``), keeping its
    attention output for backward or not (``recompute_attention_output``; opt-in: the op
    case is the same as without it)."""

    def op(r, inputs, u):
        attend = lambda q, k, v: upipe_compile.upipe_attention(  # noqa: E731
            q, k, v, is_causal=True, enable_gqa=True, cp_mesh=r.mesh, heads_per_stage=u, prefetch=prefetch)
        return attention_step(r, inputs.bhsd, attend, "bhsd")

    def block(r, inputs, u):
        model = load_block(r, Block(r.cfg), inputs)
        compiled = torch.compile(model, backend="upipe", dynamic=False, options={
            "cp_mesh": r.mesh, "heads_per_stage": u, "prefetch": prefetch, "inner_backend": r.args.inner_backend,
            "fuse_projections": fuse, "recompute_attention_output": recompute_output})
        return block_step(r, model, compiled, inputs)

    return Method(name, heads_per_stage, op, block, ours=True, default=not recompute_output)


def _deepspeed_op(r, inputs, u):
    attn = deepspeed_ulysses.distributed_attention(r.group)
    return attention_step(r, inputs.bshd, lambda q, k, v: attn(q, k, v, 0), "bshd")


def _deepspeed_block(r, inputs, u):
    model = load_block(r, deepspeed_ulysses.deepspeed_block(r.cfg, r.group), inputs)
    return block_step(r, model, torch.compile(model, backend=r.args.inner_backend, dynamic=False), inputs)


ULYSSES, UPIPE_P, DEEPSPEED, RING = "Ulysses (ours)", "UPipe U=P", "DeepSpeed Ulysses", "torch ring CP"
UPIPE_P_UNFUSED = "UPipe U=P, unfused"
UPIPE_P_RECOMPUTED = "UPipe U=P, output recomputed"
ALL_HEADS = lambda q_heads, world: q_heads  # noqa: E731

# In table order. Ulysses is the reference every other method is checked against.
METHODS = [
    upipe(ULYSSES, ALL_HEADS, "forward"),  # one stage: nothing to prefetch
    upipe(UPIPE_P, lambda q_heads, world: world, "forward"),  # the default prefetch
    upipe("UPipe U=P, no prefetch", lambda q_heads, world: world, "none"),
    upipe("UPipe U=P, prefetch both", lambda q_heads, world: world, "both"),
    upipe("UPipe U=2P", lambda q_heads, world: 2 * world, "forward"),
    upipe(UPIPE_P_UNFUSED, lambda q_heads, world: world, "forward", fuse=False),  # block: SDPA alone rewritten
    upipe(UPIPE_P_RECOMPUTED, lambda q_heads, world: world, "forward", recompute_output=True),
    Method(DEEPSPEED, ALL_HEADS, _deepspeed_op, _deepspeed_block),
    Method(RING, ALL_HEADS, lambda r, inputs, u: ring_op_step(r, inputs),
           lambda r, inputs, u: ring_block_step(r, inputs), profiled=False),
]
NAMES = [m.name for m in METHODS]


def select_methods(names: Optional[list[str]]) -> None:
    """Keep only ``names`` (and the reference, Ulysses) in METHODS, in table order; None:
    the default ones."""
    METHODS[:] = [m for m in METHODS if (m.name in names if names else m.default) or m.name == ULYSSES]


def probe_ring(r: Rank) -> Optional[str]:
    """None when torch's ring CP runs SDPA (with GQA) here, else why not (the first line of
    the error it raises). Every rank gets the same answer."""
    cfg = r.cfg
    seq = 8 * r.world
    gen = torch.Generator().manual_seed(7)
    shapes = [(1, heads, seq, 16) for heads in (cfg.q_heads, cfg.kv_heads, cfg.kv_heads, cfg.q_heads)]
    full = [torch.randn(s, generator=gen).to(r.device, r.dtype) for s in shapes]
    reason = None
    try:
        ring_attention_step(r, full, gqa=True)
    except Exception as error:  # CPU: no sharding strategy for the CPU flash kernel
        reason = first_line(error)
    if not r.all_agree(reason is None):
        reason = reason or "failed on another rank"
    return reason


def unavailable_reasons(r: Rank) -> dict[str, Optional[str]]:
    """Why each peer cannot run here (None: it can); the same on every rank."""
    ds_reason = deepspeed_ulysses.init(dist.get_backend())
    available = torch.tensor([float(ds_reason is None)], device=r.device)
    dist.all_reduce(available)
    if 0 < available.item() < r.world:
        raise RuntimeError(f"deepspeed initialised on some ranks only; here: {ds_reason}")
    return {DEEPSPEED: ds_reason, RING: probe_ring(r)}
