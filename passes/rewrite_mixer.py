"""``upipe::head_mixer`` nodes -> the ``upipe::head_mixer_loop`` stage loop over the
context-parallel group (upipe_compile/mixers): the mixer over the whole sequence, a chunk
of heads a stage."""

from __future__ import annotations

import torch
import torch.fx as fx

from upipe_compile.passes.find import _graph_modules, source_line

MAX_MIXER_STAGES = 8
"""Stages a mixer's heads (channels) are split into at most: its buffers hold 1/stages of
the whole-head all-to-all's."""


def find_mixers(gm: fx.GraphModule) -> list[tuple[fx.GraphModule, fx.Node]]:
    """Every ``upipe::head_mixer`` call (Dynamo records the packet, graphs below it the overload)."""
    targets = (torch.ops.upipe.head_mixer, torch.ops.upipe.head_mixer.default)
    return [(module, node) for module in _graph_modules(gm) for target in targets
            for node in module.graph.find_nodes(op="call_function", target=target)]


def mixer_problems(node: fx.Node, world: int, ring: bool) -> list[str]:
    """Why a mixer call cannot run as a stage loop (empty when it can)."""
    heads = mixer_heads(node)
    problems = []
    if ring:
        problems.append("token mixers (short convs, linear attention) over a ring x all-to-all cp_mesh are not "
                        "supported: use a 1-D cp_mesh")
    if heads is None or heads % world:
        problems.append(f"the mixer's {heads} heads/channels are not divisible by P={world}: use a P that divides them")
    return problems


def mixer_heads(node: fx.Node) -> int | None:
    from upipe_compile.mixers.registry import resolve

    name, tensors = node.args[0], node.args[1]
    spec, _ = resolve(name)
    # the tensors before the head-counting input are never absent (registry.KINDS)
    node_of_heads = tensors[spec.head_input]
    value = node_of_heads.meta.get("example_value", node_of_heads.meta.get("val"))
    return None if value is None else int(value.shape[spec.inputs[spec.head_input].head])


def mixer_stages(heads: int, world: int) -> int:
    per_rank = heads // world
    return max(s for s in range(1, MAX_MIXER_STAGES + 1) if per_rank % s == 0)


def rewrite_mixer(gm: fx.GraphModule, node: fx.Node, group_name: str, world: int) -> None:
    stages = mixer_stages(mixer_heads(node), world)
    name, tensors, options = node.args[:3]
    documents = node.args[3] if len(node.args) > 3 else node.kwargs.get("documents")
    with gm.graph.inserting_before(node):
        loop = gm.graph.call_function(torch.ops.upipe.head_mixer_loop.default,
                                      (name, tensors, options, documents, group_name, world, stages))
    loop.meta.update(node.meta)
    node.replace_all_uses_with(loop)
    gm.graph.erase_node(node)


__all__ = ["find_mixers", "mixer_problems", "rewrite_mixer", "source_line"]
