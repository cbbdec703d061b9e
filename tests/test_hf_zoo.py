"""benchmarks/hf_zoo.py's per-family run on 2 gloo ranks, for a family upipe runs and one it
refuses by name, so that the sweep cannot rot (the sweep itself: benchmarks/results/hf_zoo_*.md)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import hf_zoo


def test_sweep_covers_decoder_only_families_and_says_why_it_leaves_the_rest_out():
    covered, left_out = hf_zoo.families()
    assert {"llama", "mistral", "qwen3_next", "bloom"} <= set(covered)
    assert left_out["bart"] == "encoder-decoder"
    assert left_out["bert"].startswith("a masked-LM encoder")
    assert "gemma3_text" in left_out["gemma3"]


def test_tiny_config_shrinks_sizes_and_keeps_defaults():
    config = hf_zoo.tiny_config("gemma3_text")
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim) == \
        (64, 4, 2, 16)
    assert config.layer_types == ["sliding_attention", "full_attention"] and config.sliding_window < hf_zoo.SEQ_LOCAL
    assert config.use_cache is True and config.vocab_size == hf_zoo.VOCAB


def test_numbers_that_differ_are_silent_and_name_the_worst_gradient():
    logits, grads = torch.ones(1, 4, 3), {"a": torch.ones(2), "b": torch.ones(2)}
    ranks = [{"logits": torch.ones(1, 2, 3), "grads": {"a": torch.full((2,), 0.5), "b": torch.zeros(2)}},
             {"logits": torch.ones(1, 2, 3), "grads": {"a": torch.full((2,), 0.5)}}]
    assert hf_zoo._compare(ranks, logits, grads) == {"verdict": "silent", "detail": "logits 0.0e+00, grads 1.0e+00 (b)"}
    ranks[0]["grads"]["b"] = torch.ones(2)
    assert hf_zoo._compare(ranks, logits, grads)["verdict"] == "match"


@pytest.mark.parametrize("family, use_cache, verdict", [
    ("llama", "default", "match"),
    ("llama", "off", "match"),
    ("doge", "default", "refused"),
    ("lfm3", "default", "match"),  # its short conv routed to a stage loop
    ("lara_mini", "default", "match"),  # short conv and gated delta rule routed
])
def test_family_verdict(rank_pools, family, use_cache, verdict):
    row = hf_zoo.run_family(family, rank_pools(hf_zoo.WORLD), use_cache)
    assert row["verdict"] == verdict, row
    if verdict == "match":
        assert row["cache returned"] == "none", row
    else:
        assert row["detail"].startswith("DogeForCausalLM"), row
        # the file from its package, not the machine's site-packages
        assert "(transformers/models/doge/modeling_doge.py)" in row["detail"], row


def test_the_recorded_command_leaves_out_where_the_table_was_written():
    """A scratch --out folder would otherwise land in the committed table's header."""
    assert hf_zoo._without_out(["--use-cache", "off", "--out", "/tmp/zoo.md", "--families", "llama"]) == [
        "--use-cache", "off", "--families", "llama"]
    assert hf_zoo._without_out(["--out=/tmp/zoo.md", "--timeout", "60"]) == ["--timeout", "60"]
