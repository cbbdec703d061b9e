"""SwiGLU feed-forward, ``w2(silu(w1 x) * w3 x)``, over token tiles with recompute in backward:
the tokens x hidden_dim intermediates exist for one tile at a time, never for the whole local
sequence (at 655360 tokens x 14336 that is 17.5 GiB in bf16 per intermediate).

The forward keeps only its input (and the weights); the backward recomputes each tile's
``w1 x``, ``w3 x`` and their product, and turns the tile's output gradient into the tile's
rows of dL/dx plus contributions to dL/dw1, dL/dw2, dL/dw3 (accumulated in fp32).

Both directions are ``torch.library`` custom ops, so torch.compile (the per-block compile,
activation checkpointing's recompute, the UPipe rewrite) sees one opaque op: the partitioner
cannot decide to keep every tile's intermediates for backward. The backward's elementwise
steps are the ones autograd runs for the plain expression (``aten.silu_backward``, the two
products), so the gradients match it.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def check_tile_tokens(tile_tokens, what: str = "tile_tokens") -> int:
    if isinstance(tile_tokens, bool) or not isinstance(tile_tokens, int) or tile_tokens <= 0:
        raise ValueError(f"{what} must be a positive int (tokens per tile), got {tile_tokens!r}")
    return tile_tokens


def swiglu(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, tile_tokens: int) -> torch.Tensor:
    """``F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)`` over tiles of ``tile_tokens``
    tokens (all dims but the last are tokens; the last tile may be shorter)."""
    check_tile_tokens(tile_tokens)
    out = tiled_swiglu_op(x.reshape(-1, x.shape[-1]), w1, w2, w3, tile_tokens)
    return out.view(*x.shape[:-1], w2.shape[0])


def _tiles(n: int, tile_tokens: int):
    for start in range(0, n, tile_tokens):
        yield slice(start, min(start + tile_tokens, n))


# The loops are plain functions (the ops below only wrap them) so that a memory estimate
# can run them on fake tensors, where the ops themselves would run only their fake kernels.
def tiled_swiglu_forward(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                         tile_tokens: int) -> torch.Tensor:
    """x [N, D], w1/w3 [H, D], w2 [D_out, H] -> [N, D_out]."""
    out = x.new_empty(x.shape[0], w2.shape[0])
    for rows in _tiles(x.shape[0], tile_tokens):
        xt = x[rows]
        torch.mm(F.silu(F.linear(xt, w1)) * F.linear(xt, w3), w2.t(), out=out[rows])
    return out


@torch.library.custom_op("upipe::tiled_swiglu", mutates_args=())
def tiled_swiglu_op(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                    tile_tokens: int) -> torch.Tensor:
    return tiled_swiglu_forward(x, w1, w2, w3, tile_tokens)


@tiled_swiglu_op.register_fake
def _tiled_swiglu_fake(x, w1, w2, w3, tile_tokens):
    return x.new_empty(x.shape[0], w2.shape[0])


def tiled_swiglu_backward(
    grad_out: torch.Tensor, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, tile_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (dx, dw1, dw2, dw3), one tile recomputed at a time."""
    grad_x = torch.empty_like(x)
    grad_w = [torch.zeros(w.shape, dtype=torch.float32, device=w.device) for w in (w1, w2, w3)]
    for rows in _tiles(x.shape[0], tile_tokens):
        xt, gt = x[rows], grad_out[rows]
        h1, h3 = F.linear(xt, w1), F.linear(xt, w3)
        act = F.silu(h1)
        grad_w[1].add_(gt.t() @ (act * h3))
        grad_prod = gt @ w2  # dL/d(silu(h1) * h3)
        grad_h3 = grad_prod * act
        del act
        grad_act = grad_prod.mul_(h3)  # in place: one [tile, hidden] tensor fewer at the peak
        del h3
        grad_h1 = torch.ops.aten.silu_backward(grad_act, h1)
        del h1, grad_prod, grad_act
        torch.mm(grad_h1, w1, out=grad_x[rows]).addmm_(grad_h3, w3)
        grad_w[0].add_(grad_h1.t() @ xt)
        grad_w[2].add_(grad_h3.t() @ xt)
    return (grad_x, *(g.to(w.dtype) for g, w in zip(grad_w, (w1, w2, w3))))


@torch.library.custom_op("upipe::tiled_swiglu_backward", mutates_args=())
def tiled_swiglu_backward_op(
    grad_out: torch.Tensor, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, tile_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return tiled_swiglu_backward(grad_out, x, w1, w2, w3, tile_tokens)


@tiled_swiglu_backward_op.register_fake
def _tiled_swiglu_backward_fake(grad_out, x, w1, w2, w3, tile_tokens):
    return tuple(torch.empty_like(t) for t in (x, w1, w2, w3))


def _setup_context(ctx, inputs, output):
    x, w1, w2, w3, tile_tokens = inputs
    ctx.save_for_backward(x, w1, w2, w3)
    ctx.tile_tokens = tile_tokens


def _backward(ctx, grad_out):
    return (*tiled_swiglu_backward_op(grad_out.contiguous(), *ctx.saved_tensors, ctx.tile_tokens), None)


tiled_swiglu_op.register_autograd(_backward, setup_context=_setup_context)


# --- the module ---------------------------------------------------------------------------
def _known_swiglu_forwards() -> tuple:
    """Feed-forward classes whose forward is exactly ``w2(silu(w1 x) * w3 x)`` with bias-free
    Linears w1, w2, w3 (checked by reading their source; a subclass that overrides forward
    is not on the list)."""
    known = []
    try:
        from torchtitan.models.llama3.model.model import FeedForward as Llama3FeedForward
        known.append(Llama3FeedForward.forward)
    except ImportError:
        pass
    try:
        from torchtitan.models.qwen3.model.model import FeedForward as Qwen3FeedForward
        known.append(Qwen3FeedForward.forward)
    except ImportError:
        pass
    try:  # torchtitan 0.3: one FeedForward shared by its models
        from torchtitan.models.common.feed_forward import FeedForward
        known.append(FeedForward.forward)
    except ImportError:
        pass
    return tuple(known)


def swiglu_problem(module: nn.Module) -> str | None:
    """Why ``module`` cannot be tiled as a SwiGLU feed-forward, or None."""
    name = type(module).__name__
    if type(module).forward not in _known_swiglu_forwards():
        return (f"{name} is not a known SwiGLU feed-forward (torchtitan's Llama3/Qwen3 FeedForward, 0.3's "
                "common FeedForward, "
                "forward = w2(silu(w1 x) * w3 x))")
    for attr in ("w1", "w2", "w3"):
        linear = getattr(module, attr, None)
        if not isinstance(linear, nn.Linear) or linear.bias is not None or type(linear).forward is not nn.Linear.forward:
            return f"{name}.{attr} is not a bias-free nn.Linear"
    if module.w1.weight.shape != module.w3.weight.shape or module.w2.in_features != module.w1.out_features:
        return f"{name}: w1 {tuple(module.w1.weight.shape)}, w2 {tuple(module.w2.weight.shape)}, " \
               f"w3 {tuple(module.w3.weight.shape)} do not form a SwiGLU"
    return None


class SequenceTiledSwiGLU(nn.Module):
    """Replaces a SwiGLU feed-forward module: adopts its ``w1``, ``w2``, ``w3`` Linears under
    the same names (same state-dict keys, same parameters for FSDP) and runs :func:`swiglu`
    over tiles. ``init_weights`` is the replaced class's own."""

    def __init__(self, feed_forward: nn.Module, tile_tokens: int):
        super().__init__()
        problem = swiglu_problem(feed_forward)
        if problem:
            raise ValueError(f"cannot tile this feed-forward: {problem}")
        self.tile_tokens = check_tile_tokens(tile_tokens)
        self.w1, self.w2, self.w3 = feed_forward.w1, feed_forward.w2, feed_forward.w3
        self._replaced_class = type(feed_forward)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x, self.w1.weight, self.w2.weight, self.w3.weight, self.tile_tokens)

    def init_weights(self, *args, **kwargs):
        return self._replaced_class.init_weights(self, *args, **kwargs)

    def extra_repr(self) -> str:
        return f"tile_tokens={self.tile_tokens}, replaces={self._replaced_class.__qualname__}"
