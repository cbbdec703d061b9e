"""The torch.compile backend "upipe": find -> validate -> rewrite (the whole attention block
where it is head-separable and ``fuse_projections`` is on, else SDPA alone), then the inner
backend."""

from __future__ import annotations

import logging

import torch
import torch.fx as fx

from upipe_compile.errors import UnsupportedAttention
import upipe_compile.mixers.ops  # noqa: F401  (registers upipe::head_mixer*, which the passes rewrite)
from upipe_compile.options import UPipeOptions
from upipe_compile.passes import (
    BlockMatch, concatenate_filled_buffers, find_attention, find_block, find_mixers, find_token_mixing, find_unsupported_attention,
    mixer_problems, rewrite_attention, rewrite_block, rewrite_mixer, split_grouped_projections, unsupported_reasons,
)
from upipe_compile.passes.find import source_line
from upipe_compile.passes.varlen import varlen_as_document_sdpa
from upipe_compile.passes.token_mixing import TokenFlow, marking_outputs

log = logging.getLogger(__name__)

OUTPUT_DIMS = "upipe_output_sequence_dims"
"""``gm.meta`` key: each graph output's sequence dimension (None: no tokens), marked on the
outputs at run time for the graph after a graph break."""
OUTPUT_ROUTING = "upipe_output_routing_tables"
"""``gm.meta`` key: which graph outputs are routing tables (marked at run time likewise)."""


def apply_upipe_passes(gm: fx.GraphModule, options: UPipeOptions) -> fx.GraphModule:
    """Rewrite every SDPA call in ``gm`` (nested bodies included) into the stage-loop op, or
    raise UnsupportedAttention naming each call that cannot be rewritten and why (flex_attention
    and hand-written attention among them: they would see the local shard only). With
    ``options.fuse_projections`` each block whose projections, per-head ops and output
    projection are proven head-separable becomes one ``upipe::attention_block`` instead (one
    log line per block says whether it was fused, or which node blocked it and why).
    With one context-parallel rank the graph is left as it is."""
    group, ring_group = options.group, options.ring_group
    world = group.size()
    if world == 1 and ring_group is None:
        return gm
    heads_per_stage = options.stage_heads()
    if options.fuse_projections:
        split_grouped_projections(gm)  # a q/k/v projection laid out per KV group (torchtitan 0.3's wqkv)
        concatenate_filled_buffers(gm)  # keys built by slice copies (DeepSeek-V3) as the cat they are
    problems = varlen_as_document_sdpa(gm)  # torch's varlen_attn: attention over packed documents too
    matches = find_attention(gm)
    problems += [
        f"  {match.source_line}\n" + "".join(f"    - {reason}\n" for reason in reasons)
        for match in matches
        if (reasons := unsupported_reasons(match, world, heads_per_stage))
    ]
    # head-separable mixers (short convs, the gated delta rule) run as stage loops too
    mixers = find_mixers(gm)
    refused_mixers = [
        f"  {source_line(node)}\n" + "".join(f"    - {reason}\n" for reason in reasons)
        for _, node in mixers if (reasons := mixer_problems(node, world, ring_group is not None))
    ]
    # flex_attention and hand-written attention are not rewritten: they would see the local shard only
    unsupported = find_unsupported_attention(gm)
    problems += [f"  {match.source_line}\n    - {match.reason}\n" for match in unsupported]
    # any other op that mixes tokens across the sharded sequence (convolutions, scans, ...)
    flow = _token_flow(gm, matches, [node for _, node in mixers], unsupported)
    mixing = [f"  {found.source_line}\n    - {found.reason}\n" for found in flow.mixing]
    gm.meta[OUTPUT_DIMS] = flow.output_dims
    gm.meta[OUTPUT_ROUTING] = flow.routing
    if problems or refused_mixers or mixing:
        what = [f"{len(problems)} attention call(s)"] * bool(problems)
        what += [f"{len(refused_mixers)} mixer call(s)"] * bool(refused_mixers)
        what += [f"{len(mixing)} op(s) that mix tokens across the sharded sequence"] * bool(mixing)
        ranks = f"P={world} ranks" if ring_group is None else \
            f"a ring of {ring_group.size()} x {world} all-to-all ranks (P={ring_group.size() * world})"
        raise UnsupportedAttention(
            f"upipe cannot run {' and '.join(what)} with context parallelism over {ranks}:\n"
            + "".join(problems + refused_mixers + mixing)
        )
    fused = 0
    ring_group_name = "" if ring_group is None else ring_group.group_name
    for match in matches:
        block = find_block(match) if options.fuse_projections else None
        if isinstance(block, BlockMatch):
            rewrite_block(block, heads_per_stage=heads_per_stage, world_size=world, group_name=group.group_name,
                          prefetch=options.prefetch, recompute_attention_output=options.recompute_attention_output,
                          ring_group_name=ring_group_name)
            fused += 1
            log.info("upipe: fused attention block at %s (%d q / %d kv heads of %d)", match.source_line,
                     block.q_heads, block.kv_heads, block.head_dim)
            continue
        if block is not None:
            log.info("upipe: attention block at %s not fused: %s", match.source_line, block.reason)
        rewrite_attention(match, heads_per_stage, world, group.group_name, options.prefetch, ring_group_name)
    for module, node in mixers:
        rewrite_mixer(module, node, group.group_name, world)
    touched = [m.graph_module for m in matches] + [module for module, _ in mixers]
    for module in {id(m): m for m in touched}.values():
        module.graph.lint()
        module.recompile()
    log.info("upipe: rewrote %d attention call(s) (%d fused blocks) and %d mixer(s), P=%d, heads_per_stage=%d",
             len(matches), fused, len(mixers), world, heads_per_stage)
    return gm


def _token_flow(gm: fx.GraphModule, matches, mixers, unsupported) -> TokenFlow:
    """Ops other than the attention and mixer calls upipe rewrites that need other ranks'
    tokens (the parts of hand-written attention already refused are not named twice), and the
    outputs' sequence dimensions."""
    rewritten = {match.node for match in matches} | set(mixers)
    lengths = {n for n in map(_query_length, matches) if n}
    known = {node for match in unsupported for node in (match.node, match.scores, match.output) if node is not None}
    functions = {_function_of(match.source_line) for match in unsupported}
    flow = find_token_mixing(gm, rewritten.__contains__, lengths)
    flow.mixing = [item for item in flow.mixing
                   if item.node not in known and _function_of(item.source_line) not in functions]
    return flow


def _function_of(source_line: str) -> str:
    """``file in function`` of a ``file:line in function: code`` source line."""
    where, _, _ = source_line.partition(": ")
    file, _, rest = where.partition(":")
    return f"{file} {rest.partition(' in ')[2]}"


def _query_length(match) -> int | None:
    value = match.query.meta.get("example_value", match.query.meta.get("val"))
    return int(value.shape[-2]) if isinstance(value, torch.Tensor) and isinstance(value.shape[-2], int) else None


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


def _inner_backend(name: str):
    if name == "eager":
        return lambda gm, example_inputs: gm.forward
    from torch._dynamo.backends.registry import lookup_backend

    return lookup_backend(name)


def upipe_backend(gm: fx.GraphModule, example_inputs, options=None, **unused):
    """``torch.compile(model, backend="upipe", options={...})``; see UPipeOptions."""
    if unused.get("mode") not in (None, "default"):
        raise UnsupportedAttention(f"backend='upipe' takes options=..., not mode={unused['mode']!r}")
    opts = UPipeOptions.from_user(options)
    if opts.group.size() > 1 or opts.ring_group is not None:
        _never_fall_back_to_eager()
    gm = apply_upipe_passes(gm, opts)
    compiled = _inner_backend(opts.inner_backend)(gm, example_inputs)
    return marking_outputs(compiled, gm.meta.get(OUTPUT_DIMS, []), gm.meta.get(OUTPUT_ROUTING, []))
