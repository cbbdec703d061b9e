"""Graph passes of the upipe backend: find -> validate -> rewrite (pure FX code)."""

from upipe_compile.passes.find import AttentionMatch, find_attention
from upipe_compile.passes.rewrite import rewrite_attention
from upipe_compile.passes.validate import unsupported_reasons

__all__ = ["AttentionMatch", "find_attention", "rewrite_attention", "unsupported_reasons"]
