"""The mixer ops: ``upipe::head_mixer`` (what models call; the mixer as it is) and
``upipe::head_mixer_loop`` (what the backend rewrites it into under context parallelism), with
their backward ops, fake kernels and autograd; the loops they run are in
:mod:`upipe_compile.mixers.loop`.

The loop splits the mixer's heads into stages. Each stage all-to-alls its inputs from this
rank's shard of the sequence to ``n`` heads over the whole sequence (per-head parameters are
sliced to the same heads), runs the mixer, and all-to-alls the output back into its heads'
slice of the local output. Backward runs stage by stage too: the stage's inputs are
exchanged again, the mixer recomputed under autograd, and the input gradients exchanged
back; parameter gradients land in this rank's slices (summed over ranks, as every
replicated parameter's). Only the local inputs are saved: a stage's buffers live one stage.
"""

from __future__ import annotations

from typing import Optional

import torch

from upipe_compile.attention.collectives import check_same_local_shape, group_from_name
from upipe_compile.mixers.loop import document_bounds, recompute_grads, loop_backward, loop_forward, run_mixer
from upipe_compile.mixers.registry import decode, resolve

Tensors = list[torch.Tensor]
"""The mixer's tensors that are present; options' ``"absent"`` lists the positions of the
others (a conv without bias), which the mixer gets as None."""


def _full(tensors, options: dict) -> list:
    """The mixer's tensor arguments in order, None where absent."""
    absent = set(options.get("absent", ()))
    present = iter(tensors)
    return [None if i in absent else next(present) for i in range(len(tensors) + len(absent))]


# --- the ops -------------------------------------------------------------------------------
# Each backward is a custom op too: tracing sees one opaque call (whose implementation may
# read the documents' boundaries on the host), not the recompute inside it.
@torch.library.custom_op("upipe::head_mixer", mutates_args=())
def head_mixer(name: str, tensors: Tensors, options: str, documents: Optional[torch.Tensor] = None) -> torch.Tensor:
    spec, implementation = resolve(name)
    settings = decode(options)
    full = _full(tensors, settings)
    out = run_mixer(spec, implementation, full, settings, document_bounds(documents))
    return out.to(dtype=spec.output_like(full).dtype, copy=True)


@torch.library.custom_op("upipe::head_mixer_backward", mutates_args=())
def head_mixer_backward(name: str, tensors: Tensors, options: str, documents: Optional[torch.Tensor],
                        dout: torch.Tensor) -> list[torch.Tensor]:
    spec, implementation = resolve(name)
    settings = decode(options)
    full = _full(tensors, settings)
    grads = recompute_grads(spec, implementation, full, settings, dout, document_bounds(documents))
    return _present(grads, full)


@torch.library.custom_op("upipe::head_mixer_loop", mutates_args=())
def head_mixer_loop(name: str, tensors: Tensors, options: str, documents: Optional[torch.Tensor], group_name: str,
                    world: int, stages: int) -> torch.Tensor:
    spec, implementation = resolve(name)
    settings = decode(options)
    # the all-to-alls are sized by this rank's shard: every rank's must be the same first
    check_same_local_shape(tuple(tensors[0].shape), group_from_name(group_name))
    return loop_forward(spec, implementation, _full(tensors, settings), settings, group_name, world, stages,
                        document_bounds(documents))


@torch.library.custom_op("upipe::head_mixer_loop_backward", mutates_args=())
def head_mixer_loop_backward(name: str, tensors: Tensors, options: str, documents: Optional[torch.Tensor],
                             group_name: str, world: int, stages: int, dout: torch.Tensor) -> list[torch.Tensor]:
    spec, implementation = resolve(name)
    settings = decode(options)
    full = _full(tensors, settings)
    grads = loop_backward(spec, implementation, full, settings, group_name, world, stages, dout, document_bounds(documents))
    return _present(grads, full)


def _present(grads: list, full: list) -> list[torch.Tensor]:
    """One gradient per present tensor (zeros where the mixer gives none)."""
    return [torch.zeros_like(t) if g is None else g for g, t in zip(grads, full) if t is not None]


@head_mixer.register_fake
def _head_mixer_fake(name, tensors, options, documents=None):
    spec, _ = resolve(name)
    return spec.output_like(_full(tensors, decode(options)))


@head_mixer_loop.register_fake
def _head_mixer_loop_fake(name, tensors, options, documents, group_name, world, stages):
    spec, _ = resolve(name)
    return spec.output_like(_full(tensors, decode(options)))


@head_mixer_backward.register_fake
def _head_mixer_backward_fake(name, tensors, options, documents, dout):
    return [torch.empty_like(t) for t in tensors]


@head_mixer_loop_backward.register_fake
def _head_mixer_loop_backward_fake(name, tensors, options, documents, group_name, world, stages, dout):
    return [torch.empty_like(t) for t in tensors]


def _setup(ctx, inputs, output):
    """Save the inputs (and the boundaries) as tensors; the other arguments as they are."""
    tensors, documents = inputs[1], inputs[3]
    ctx.other = (inputs[0], inputs[2]) + tuple(inputs[4:])
    ctx.count, ctx.has_documents = len(tensors), documents is not None
    ctx.save_for_backward(*tensors, *([documents] if documents is not None else []))


def _saved(ctx):
    saved = list(ctx.saved_tensors)
    return saved[:ctx.count], (saved[ctx.count] if ctx.has_documents else None)


def _plain_backward(ctx, dout):
    tensors, documents = _saved(ctx)
    name, options = ctx.other
    grads = torch.ops.upipe.head_mixer_backward(name, tensors, options, documents, dout.contiguous())
    return None, list(grads), None, None


def _loop_backward(ctx, dout):
    tensors, documents = _saved(ctx)
    name, options, group_name, world, stages = ctx.other
    grads = torch.ops.upipe.head_mixer_loop_backward(name, tensors, options, documents, group_name, world, stages,
                                                     dout.contiguous())
    return None, list(grads), None, None, None, None, None


torch.library.register_autograd("upipe::head_mixer", _plain_backward, setup_context=_setup)
torch.library.register_autograd("upipe::head_mixer_loop", _loop_backward, setup_context=_setup)
