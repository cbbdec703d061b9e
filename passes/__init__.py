"""Graph passes of the upipe backend (pure FX code), run in order by
:mod:`upipe_compile.passes.pipeline`: find the attention calls, mixers and refused ops (matches
that own their nodes), refuse what cannot run under context parallelism, replace the rest."""

from upipe_compile.passes.attention_match import AttentionMatch, unsupported_reasons
from upipe_compile.passes.block_match import BlockMatch, NotFusable
from upipe_compile.passes.context import PassContext
from upipe_compile.passes.filled_buffers import concatenate_filled_buffers
from upipe_compile.passes.find import find_attention
from upipe_compile.passes.find_block import find_block
from upipe_compile.passes.find_unsupported import UnsupportedMatch, find_unsupported_attention
from upipe_compile.passes.grouped_projections import split_grouped_projections
from upipe_compile.passes.mixer_match import MixerMatch, find_mixers
from upipe_compile.passes.pipeline import PASSES, run_passes
from upipe_compile.passes.token_mixing import TokenFlow, find_token_mixing
from upipe_compile.passes.token_mixing_refusal import TokenMixing

__all__ = ["PASSES", "AttentionMatch", "BlockMatch", "MixerMatch", "NotFusable", "PassContext", "TokenFlow",
           "TokenMixing", "UnsupportedMatch", "concatenate_filled_buffers", "find_attention", "find_block",
           "find_mixers", "find_token_mixing", "find_unsupported_attention", "run_passes",
           "split_grouped_projections", "unsupported_reasons"]
