"""``upipe::head_mixer`` calls as matches: each becomes the ``upipe::head_mixer_loop`` stage loop
over the context-parallel group (upipe_compile/mixers): the mixer over the whole sequence, a
chunk of heads a stage."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from upipe_compile.mixers.registry import resolve
from upipe_compile.passes.context import MIXER_CALLS, PassContext
from upipe_compile.passes.graph_utils import example, graph_modules, source_line

MAX_MIXER_STAGES = 8
"""Stages a mixer's heads (channels) are split into at most: its buffers hold 1/stages of
the whole-head all-to-all's."""


@dataclass
class MixerMatch:
    """One ``upipe::head_mixer`` call."""

    graph_module: fx.GraphModule
    node: fx.Node
    refusal_kind = MIXER_CALLS

    @property
    def source_line(self) -> str:
        return source_line(self.node)

    @property
    def heads(self) -> int | None:
        """The mixer's heads (or channels), read from the input that counts them."""
        name, tensors = self.node.args[0], self.node.args[1]
        spec, _ = resolve(name)
        # the tensors before the head-counting input are never absent (registry.KINDS)
        value = example(tensors[spec.head_input])
        return None if value is None else int(value.shape[spec.inputs[spec.head_input].head])

    def problems(self, ctx: PassContext) -> list[str]:
        """Why the call cannot run as a stage loop (empty when it can)."""
        problems = []
        if ctx.ring_group_name:
            problems.append("token mixers (short convs, linear attention) over a ring x all-to-all cp_mesh are not "
                            "supported: use a 1-D cp_mesh")
        heads = self.heads
        if heads is None or heads % ctx.world:
            problems.append(f"the mixer's {heads} heads/channels are not divisible by P={ctx.world}: use a P that "
                            "divides them")
        return problems

    def replace(self, ctx: PassContext) -> None:
        node, graph = self.node, self.graph_module.graph
        stages = mixer_stages(self.heads, ctx.world)
        name, tensors, options = node.args[:3]
        documents = node.args[3] if len(node.args) > 3 else node.kwargs.get("documents")
        with graph.inserting_before(node):
            loop = graph.call_function(torch.ops.upipe.head_mixer_loop.default,
                                       (name, tensors, options, documents, ctx.group_name, ctx.world, stages))
        loop.meta.update(node.meta)
        node.replace_all_uses_with(loop)
        graph.erase_node(node)
        ctx.touch(self.graph_module)


def find_mixers(gm: fx.GraphModule) -> list[MixerMatch]:
    """Every ``upipe::head_mixer`` call (Dynamo records the packet, graphs below it the overload)."""
    targets = (torch.ops.upipe.head_mixer, torch.ops.upipe.head_mixer.default)
    return [MixerMatch(module, node) for module in graph_modules(gm) for target in targets
            for node in module.graph.find_nodes(op="call_function", target=target)]


def mixer_stages(heads: int, world: int) -> int:
    per_rank = heads // world
    return max(s for s in range(1, MAX_MIXER_STAGES + 1) if per_rank % s == 0)
