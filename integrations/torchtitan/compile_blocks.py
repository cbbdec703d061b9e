"""The switch to upipe and the per-block torch.compile, shared by both torchtitan releases.

A job runs upipe's context parallelism when it compiles with ``compile.backend = "upipe"``
(0.2.2's ``[compile] backend``, 0.3's ``compile.backend``); its TransformerBlocks are then each
compiled with upipe's backend over the job's CP mesh, with the options of its upipe section,
read once per job (:func:`compile_options`).

For a job config marked by ``measurement.mark_for_measurement`` (the whole-step memory
estimate's) nothing is compiled: each block's SDPA runs eagerly through the real stage loops
instead (see measurement.py).
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn

from upipe_compile.backend import inner_backend as compiler_for
from upipe_compile.backend import upipe_backend
from upipe_compile.integrations.torchtitan.config import upipe_config
from upipe_compile.integrations.torchtitan.cp_layout import upipe_cp_mesh
from upipe_compile.integrations.torchtitan.measurement import is_measuring

log = logging.getLogger(__name__)

BACKEND = "upipe"


def upipe_enabled(job_config) -> bool:
    return job_config.compile.enable and job_config.compile.backend == BACKEND


def compile_options(job_config, parallel_dims) -> dict:
    """The options each block is compiled with (``cp_mesh``: torchtitan's CP mesh, or its
    (cp_ring, cp_a2a) unflattening with upipe's ring_degree > 1)."""
    cfg = upipe_config(job_config)
    return {"cp_mesh": upipe_cp_mesh(job_config, parallel_dims), "inner_backend": cfg.inner_backend,
            "prefetch": cfg.prefetch, "fuse_projections": cfg.fuse_projections,
            "recompute_attention_output": cfg.recompute_attention_output,
            "heads_per_stage": cfg.heads_per_stage_option}


def inner_backend(name: str):
    """What torch.compile takes for upipe's inner backend ``name`` (the callable for "eager")."""
    return name if name != "eager" else compiler_for(name)


def _backend_and_options(job_config, parallel_dims):
    """upipe's backend and the job's options over its CP mesh; with CP = 1 there is nothing to
    rewrite: the inner backend, no options."""
    if not parallel_dims.cp_enabled:
        return inner_backend(upipe_config(job_config).inner_backend), None
    # The backend callable, not its name: the name resolves only through the package's entry
    # point, which a source checkout on PYTHONPATH does not have.
    return upipe_backend, compile_options(job_config, parallel_dims)


def compile_blocks(model: nn.Module, job_config, parallel_dims) -> None:
    """Per-block torch.compile, as torchtitan's apply_compile, but with backend "upipe" and
    the CP mesh, each block's forward compiled in place. With CP = 1 there is nothing to
    rewrite: the inner backend compiles the blocks."""
    if is_measuring(job_config):
        route_blocks_through_stage_loops(model, job_config, parallel_dims)
        return
    backend, options = _backend_and_options(job_config, parallel_dims)
    for block in model.layers.values():
        # each block its own copy of the options: the backend may keep what it is given
        given = {"options": dict(options)} if options is not None else {}
        # In place, no OptimizedModule wrapper: the state_dict keeps the model's names (no
        # "_orig_mod."), so a checkpoint loads into a job with or without upipe. The forward,
        # not the whole call (nn.Module.compile): hooks put on the block later (FSDP's, the
        # block-input offload's saved-tensor hooks) stay eager around the compiled forward.
        block.forward = torch.compile(block.forward, backend=backend, fullgraph=True, **given)
    log.info("upipe: compiled %d TransformerBlocks (CP=%d)", len(model.layers), parallel_dims.cp)


def compile_attention_alone(model: nn.Module, job_config, parallel_dims) -> None:
    """With tensor parallelism or MoE layers: each layer's inner attention compiled with backend
    "upipe" over the CP mesh, before 0.3's ``model.parallelize`` (whose TP ``local_map`` then
    hands it its TP rank's heads as local tensors, this rank's CP shard of the tokens). The
    projections, norms, MLP and experts stay 0.3's eager modules (TP's DTensor ops, the
    experts' token dispatch); the blocks are not compiled (a block compiled around the
    attention would inline it, and upipe would see DTensor projections or the dispatch, which
    its token-mixing guard refuses). The attention runs as the plain stage-loop op:
    fuse_projections is off (job_rules.py). Measuring (the whole-step estimate), the same
    rewrite runs the stage-loop op's eager twin (eager_twins.py)."""
    backend, options = _backend_and_options(job_config, parallel_dims)
    if is_measuring(job_config):
        if options is None:
            return  # CP = 1: nothing to rewrite, the attention runs as it is
        from upipe_compile.measure.eager_twins import eager_twin_backend

        # static shapes, as the fused path's measurement: the max-context search changes seq_len
        backend, static = eager_twin_backend, {"dynamic": False}
    else:
        static = {}
    for block in model.layers.values():
        inner = block.attention.inner_attention
        given = {**static, **({"options": dict(options)} if options is not None else {})}
        inner.forward = torch.compile(inner.forward, backend=backend, fullgraph=True, **given)
    log.info("upipe: compiled the attention of %d TransformerBlocks alone (CP=%d, TP=%d, EP=%d)", len(model.layers),
             parallel_dims.cp, parallel_dims.tp, parallel_dims.ep)


def route_blocks_through_stage_loops(model: nn.Module, job_config, parallel_dims) -> None:
    """What compile_blocks does to attention, eagerly, for fake-tensor memory measurement: every
    block's attention runs as the real stage loops with the options it would be compiled with. The
    routing sits inside the activation-checkpoint wrapper, so AC's recompute in backward is
    routed too. With CP = 1 nothing is rewritten, as in compile_blocks."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from upipe_compile.measure.eager_twins import eager_twin_backend
    from upipe_compile.measure.memory import SDPAThroughStageLoops
    from upipe_compile.options import UPipeOptions

    if not parallel_dims.cp_enabled:
        return
    user_options = compile_options(job_config, parallel_dims)
    options = UPipeOptions.from_user(dict(user_options))
    for block in model.layers.values():
        inner = block._checkpoint_wrapped_module if isinstance(block, CheckpointWrapper) else block
        # 0.3's inner attention module (varlen_attn, which SDPAThroughStageLoops does not see)
        kernel = getattr(inner.attention, "inner_attention", None)
        if options.fuse_projections or kernel is not None:
            # The fusion pass needs the graph, and varlen needs the rewrite: the attention module
            # (unfused: 0.3's inner attention) is compiled with the same passes and options as
            # training, its ops swapped for their eager twins (eager_twins.py).
            module = inner.attention if options.fuse_projections else kernel
            module.forward = torch.compile(module.forward, backend=eager_twin_backend, options=dict(user_options),
                                           fullgraph=True, dynamic=False)
        else:
            _run_forward_under(inner, lambda: SDPAThroughStageLoops(options.group, options.stage_heads(),
                                                                    options.prefetch, options.ring_group))


def _run_forward_under(module: nn.Module, make_mode) -> None:
    forward = module.forward

    def routed_forward(*args, **kwargs):
        with make_mode():
            return forward(*args, **kwargs)

    module.forward = routed_forward
