"""Graph passes of the upipe backend (pure FX code): find -> validate -> rewrite (SDPA alone),
and find_block -> head_separable -> rewrite_block (the whole attention block)."""

from upipe_compile.passes.filled_buffers import concatenate_filled_buffers
from upipe_compile.passes.find import AttentionMatch, find_attention
from upipe_compile.passes.find_block import BlockMatch, NotFusable, find_block
from upipe_compile.passes.grouped_projections import split_grouped_projections
from upipe_compile.passes.find_unsupported import UnsupportedMatch, find_unsupported_attention
from upipe_compile.passes.rewrite import rewrite_attention
from upipe_compile.passes.rewrite_block import rewrite_block
from upipe_compile.passes.rewrite_mixer import find_mixers, mixer_problems, rewrite_mixer
from upipe_compile.passes.token_mixing import TokenMixing, find_token_mixing, mark_sequence_dim
from upipe_compile.passes.validate import unsupported_reasons

__all__ = ["AttentionMatch", "BlockMatch", "NotFusable", "TokenMixing", "UnsupportedMatch", "concatenate_filled_buffers",
           "find_attention",
           "find_block", "find_token_mixing", "find_unsupported_attention", "mark_sequence_dim",
           "find_mixers", "mixer_problems", "rewrite_attention", "rewrite_block", "rewrite_mixer",
           "split_grouped_projections", "unsupported_reasons"]
