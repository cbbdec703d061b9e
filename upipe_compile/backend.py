"""The torch.compile backend "upipe": options -> the graph passes (:mod:`upipe_compile.passes.
pipeline`: find, refuse, rewrite each attention block or SDPA call and each mixer) -> the inner
backend, whose compiled graph marks its outputs' sequence dimensions at run time."""

from __future__ import annotations

import logging

import torch
import torch.fx as fx

import upipe_compile.mixers.ops  # noqa: F401  (registers upipe::head_mixer*, which the passes rewrite)
from upipe_compile.errors import UnsupportedAttention
from upipe_compile.options import UPipeOptions
from upipe_compile.passes.context import PassContext
from upipe_compile.passes.pipeline import run_passes
from upipe_compile.sequence_marks import marking_outputs

log = logging.getLogger(__name__)


def apply_upipe_passes(gm: fx.GraphModule, options: UPipeOptions) -> fx.GraphModule:
    """Every SDPA call of ``gm`` (nested bodies included) as the stage-loop op, or each
    head-separable attention block as one ``upipe::attention_block``, and each mixer as a stage
    loop; or UnsupportedAttention naming each call upipe cannot run and why. One rank: unchanged."""
    return run_passes(gm, PassContext.of(options)) if _context_parallel(options) else gm


def _context_parallel(options: UPipeOptions) -> bool:
    return options.group.size() > 1 or options.ring_group is not None


def _never_fall_back_to_eager() -> None:
    """Dynamo runs a frame uncompiled when it hits the recompile limit, and when a compile
    error is suppressed (``suppress_errors``): under context parallelism that frame's
    attention would see the local shard only, a silent wrong answer. Both become errors."""
    config = torch._dynamo.config
    if getattr(config, "suppress_errors", False):
        log.warning("upipe: torch._dynamo.config.suppress_errors set to False: a frame that failed to compile "
                    "would run its attention on the local shard only")
        config.suppress_errors = False
    if hasattr(config, "fail_on_recompile_limit_hit") and not config.fail_on_recompile_limit_hit:
        config.fail_on_recompile_limit_hit = True


def inner_backend(name: str):
    """The compiler callable for upipe's inner backend ``name`` (what compiles each graph after
    the rewrite): a registered torch.compile backend, or "eager" (the graph as it is)."""
    if name == "eager":
        return lambda gm, example_inputs: gm.forward
    from torch._dynamo.backends.registry import lookup_backend

    return lookup_backend(name)


def upipe_backend(gm: fx.GraphModule, example_inputs, options=None, **unused):
    """``torch.compile(model, backend="upipe", options={...})``; see UPipeOptions."""
    if unused.get("mode") not in (None, "default"):
        raise UnsupportedAttention(f"backend='upipe' takes options=..., not mode={unused['mode']!r}")
    opts = UPipeOptions.from_user(options)
    ctx = None
    if _context_parallel(opts):
        _never_fall_back_to_eager()
        ctx = PassContext.of(opts)
        gm = run_passes(gm, ctx)
    compiled = inner_backend(opts.inner_backend)(gm, example_inputs)
    # the graph after a graph break starts from the outputs' sequence dimensions
    return compiled if ctx is None else marking_outputs(compiled, ctx.output_dims, ctx.output_routing)
