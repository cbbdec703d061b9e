"""Output projection + cross-entropy over token chunks: the logits never exist for the whole
local sequence.

The plain path, ``F.cross_entropy(F.linear(h, W).float(), labels, reduction="sum",
ignore_index=-100)``, holds N x V logits (and an fp32 copy, and its gradient): at 655360
tokens per rank x 128256 vocab that is hundreds of GiB. Here the forward computes, chunk by
chunk, the logits, their log-sum-exp and the picked logit, and keeps only the per-token
log-sum-exp (N fp32 values). The backward recomputes each chunk's logits and turns them into
that chunk's gradient, ``grad * (softmax - onehot(label))`` with ignored rows zero, then into
the chunk's rows of dL/dh and a contribution to dL/dW (accumulated in fp32).

Both directions are ``torch.library`` custom ops, so torch.compile treats them as opaque:
neither CSE nor the partitioner can merge the backward's recomputed logits with the
forward's and keep them alive.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

IGNORE_INDEX = -100  # torch's and torchtitan's default


class LazyLogits(NamedTuple):
    """What the output projection returns instead of logits: the final hidden states and the
    projection weight. A NamedTuple is a pytree node, so FSDP2 sees (and hooks) both tensors."""

    hidden: torch.Tensor
    """[..., D] final-norm output."""
    weight: torch.Tensor
    """[V, D] output projection weight (FSDP's unsharded parameter inside a training step)."""

    def materialize(self) -> torch.Tensor:
        """The full logits, for callers that do want them (evaluation, debugging)."""
        return F.linear(self.hidden, self.weight)


class LazyOutputProjection(nn.Module):
    """Stands in for a bias-free ``nn.Linear`` output layer. It adopts the Linear's ``weight``
    parameter under the same name, so state-dict keys, initialisation and FSDP sharding see
    the same parameter; its forward returns :class:`LazyLogits` instead of multiplying."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"LazyOutputProjection replaces an nn.Linear, got {type(linear).__name__}")
        if linear.bias is not None:
            raise ValueError("LazyOutputProjection needs a bias-free output Linear (the chunked loss has no bias term)")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight

    def forward(self, hidden: torch.Tensor) -> LazyLogits:
        return LazyLogits(hidden, _StepAlias.apply(self.weight))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features} (logits computed by the loss)"


class _StepAlias(torch.autograd.Function):
    """The weight as a new, non-view tensor on the same memory, with gradient passed through.
    FSDP2 puts a pre-backward hook on every grad-requiring tensor of a module's output: on the
    parameter itself those hooks would pile up, one more every step; on a view FSDP warns
    (in-place ops on views drop its hook). This alias lives for one step."""

    @staticmethod
    def forward(ctx, weight):
        return weight.detach()

    @staticmethod
    def backward(ctx, grad):
        return grad


def check_chunk_tokens(chunk_tokens, what: str = "chunk_tokens") -> int:
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens <= 0:
        raise ValueError(f"{what} must be a positive int (tokens per chunk), got {chunk_tokens!r}")
    return chunk_tokens


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight).flatten(0, -2).float(), labels.flatten(),
    reduction="sum", ignore_index=ignore_index)`` computed ``chunk_tokens`` tokens at a time;
    same value and gradients (for hidden and weight), fp32 scalar."""
    check_chunk_tokens(chunk_tokens)
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} disagree on the token dims")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)} is not [vocab, {hidden.shape[-1]}]")
    loss, _ = linear_cross_entropy_op(
        hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), chunk_tokens, ignore_index,
    )
    return loss


def lazy_logits_cross_entropy(pred: LazyLogits, labels: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """torchtitan's loss signature ``(pred, labels) -> summed loss`` over :class:`LazyLogits`."""
    if not isinstance(pred, LazyLogits):
        raise TypeError(
            f"the chunked loss needs the model to return LazyLogits (its output layer replaced by "
            f"LazyOutputProjection), got {type(pred).__name__}"
        )
    return linear_cross_entropy(pred.hidden, pred.weight, labels, chunk_tokens)


def _chunks(n: int, chunk_tokens: int):
    for start in range(0, n, chunk_tokens):
        yield slice(start, min(start + chunk_tokens, n))


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, rows: slice) -> torch.Tensor:
    # As the plain path: the matmul in the activation dtype, then the fp32 copy.
    return F.linear(hidden[rows], weight).float()


# The loops are plain functions (the ops below only wrap them) so that a memory estimate
# can run them on fake tensors, where the ops themselves would run only their fake kernels.
def linear_cross_entropy_forward(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int, ignore_index: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [N, D], weight [V, D], labels [N] -> (summed loss fp32 [], log-sum-exp fp32 [N])."""
    n = hidden.shape[0]
    lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for rows in _chunks(n, chunk_tokens):
        logits = _chunk_logits(hidden, weight, rows)
        torch.logsumexp(logits, dim=-1, out=lse[rows])
        target = labels[rows]
        valid = target != ignore_index
        picked = logits.gather(1, target.masked_fill(~valid, 0).unsqueeze(1)).squeeze(1)
        del logits
        loss += torch.where(valid, lse[rows] - picked, 0.0).sum()
    return loss, lse


@torch.library.custom_op("upipe::linear_cross_entropy", mutates_args=())
def linear_cross_entropy_op(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int, ignore_index: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    return linear_cross_entropy_forward(hidden, weight, labels, chunk_tokens, ignore_index)


@linear_cross_entropy_op.register_fake
def _linear_cross_entropy_fake(hidden, weight, labels, chunk_tokens, ignore_index):
    return hidden.new_empty((), dtype=torch.float32), hidden.new_empty(hidden.shape[0], dtype=torch.float32)


def linear_cross_entropy_backward(
    grad_loss: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor,
    chunk_tokens: int, ignore_index: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (dL/dhidden [N, D] in hidden's dtype, dL/dweight [V, D] in weight's dtype)."""
    grad_hidden = torch.empty_like(hidden)
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    for rows in _chunks(hidden.shape[0], chunk_tokens):
        grad_logits = _chunk_logits(hidden, weight, rows)
        grad_logits.sub_(lse[rows].unsqueeze(1)).exp_()  # softmax
        target = labels[rows]
        valid = target != ignore_index
        grad_logits.scatter_add_(1, target.masked_fill(~valid, 0).unsqueeze(1),
                                 torch.full((target.shape[0], 1), -1.0, device=grad_logits.device))
        grad_logits.mul_((valid.unsqueeze(1) * grad_loss))
        # As autograd does for the plain path's .float(): the gradient goes back in the
        # activation dtype before it meets the matmul.
        grad_logits = grad_logits.to(hidden.dtype)
        torch.mm(grad_logits, weight, out=grad_hidden[rows])
        grad_weight.add_(grad_logits.t() @ hidden[rows])
        del grad_logits
    return grad_hidden, grad_weight.to(weight.dtype)


@torch.library.custom_op("upipe::linear_cross_entropy_backward", mutates_args=())
def linear_cross_entropy_backward_op(
    grad_loss: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor,
    chunk_tokens: int, ignore_index: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    return linear_cross_entropy_backward(grad_loss, hidden, weight, labels, lse, chunk_tokens, ignore_index)


@linear_cross_entropy_backward_op.register_fake
def _linear_cross_entropy_backward_fake(grad_loss, hidden, weight, labels, lse, chunk_tokens, ignore_index):
    return torch.empty_like(hidden), torch.empty_like(weight)


def _setup_context(ctx, inputs, output):
    hidden, weight, labels, chunk_tokens, ignore_index = inputs
    _, lse = output
    ctx.save_for_backward(hidden, weight, labels, lse)
    ctx.args = (chunk_tokens, ignore_index)


def _backward(ctx, grad_loss, _grad_lse):
    hidden, weight, labels, lse = ctx.saved_tensors
    grad_hidden, grad_weight = linear_cross_entropy_backward_op(grad_loss, hidden, weight, labels, lse, *ctx.args)
    return grad_hidden, grad_weight, None, None, None


linear_cross_entropy_op.register_autograd(_backward, setup_context=_setup_context)
