"""What every pass of :mod:`upipe_compile.passes.pipeline` shares: the settings of the rewrite,
read once from the options, and what earlier passes found (the matches). A match owns its nodes,
says what keeps it from running under context parallelism (``problems``) and replaces itself
(``replace``); a refused op is a match with a problem and no replacement."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch.fx as fx

from upipe_compile.sequence_marks import cut_lengths

if TYPE_CHECKING:
    from upipe_compile.passes.attention_match import AttentionMatch
    from upipe_compile.passes.mixer_match import MixerMatch

ATTENTION_CALLS = "attention call(s)"
MIXER_CALLS = "mixer call(s)"
TOKEN_MIXING_OPS = "op(s) that mix tokens across the sharded sequence"
REFUSAL_KINDS = (ATTENTION_CALLS, MIXER_CALLS, TOKEN_MIXING_OPS)
"""How a refusal counts its matches, in the order it names them."""


@dataclass
class PassContext:
    """The rewrite's settings and what the passes found, in pass order."""

    world: int
    """Ranks of the all-to-all group (P, or A with a ring)."""
    heads_per_stage: int
    group_name: str
    ring_group_name: str
    """The ring's process group ("" without a ring)."""
    ring_size: int
    prefetch: str
    recompute_attention_output: bool
    fuse_projections: bool
    cut_lengths: frozenset
    """Shard lengths cut over the group (:func:`upipe_compile.sequence_marks.cut_lengths`)."""
    attention: list[AttentionMatch] = field(default_factory=list)
    """:class:`~upipe_compile.passes.attention_match.AttentionMatch` of every SDPA call."""
    mixers: list[MixerMatch] = field(default_factory=list)
    """:class:`~upipe_compile.passes.mixer_match.MixerMatch` of every head mixer call."""
    refused: list[RefusedOp] = field(default_factory=list)
    """Refused ops (:class:`RefusedOp`): varlen calls, flex and hand-written attention, token mixing."""
    output_dims: list = field(default_factory=list)
    """Each graph output's sequence dimension (None: no tokens), marked on it at run time."""
    output_routing: list = field(default_factory=list)
    """Which graph outputs are routing tables (marked at run time likewise)."""
    touched: dict = field(default_factory=dict)
    """id -> graph module a replacement changed (linted and recompiled once, at the end)."""
    fused_blocks: int = 0

    @classmethod
    def of(cls, options) -> "PassContext":
        """The settings of :class:`~upipe_compile.options.UPipeOptions`, read once."""
        ring = options.ring_group
        return cls(options.group.size(), options.stage_heads(), options.group.group_name,
                   "" if ring is None else ring.group_name, 1 if ring is None else ring.size(),
                   options.prefetch, options.recompute_attention_output, options.fuse_projections,
                   cut_lengths(options.group))

    def touch(self, module: fx.GraphModule) -> None:
        self.touched[id(module)] = module

    def ranks(self) -> str:
        if not self.ring_group_name:
            return f"P={self.world} ranks"
        return f"a ring of {self.ring_size} x {self.world} all-to-all ranks (P={self.ring_size * self.world})"


class Match(Protocol):
    """What every kind of match the refusal pass sees is (attention, mixer, refused op): found
    by its pass in one module beside its finder, it owns its nodes, names the model's source
    line, says what keeps it from running under context parallelism (``problems``: [] when
    nothing) and rewrites the graph (``replace``, never called on a match with problems). A
    fused block is found after the refusal, for attention that passed it: it only replaces."""

    @property
    def source_line(self) -> str: ...

    def problems(self, ctx: PassContext) -> list[str]: ...

    def replace(self, ctx: PassContext) -> None: ...


class RefusedOp:
    """A match upipe never rewrites: its one problem is the refusal (``reason``), naming the fix."""

    refusal_kind = ATTENTION_CALLS
    source_line: str
    reason: str

    def problems(self, ctx: PassContext) -> list[str]:
        return [self.reason]

    def replace(self, ctx: PassContext) -> None:
        raise AssertionError(f"{self.source_line}: a refused op is never replaced")


@dataclass
class Refusal(RefusedOp):
    """A call refused by the pass that found it, with every reason (e.g. a varlen call)."""

    source_line: str
    reasons: list

    def problems(self, ctx: PassContext) -> list[str]:
        return list(self.reasons)
