"""transformers families whose attention register() cannot reach (a mask read as a tensor)
are refused by name when built with register(), instead of a crash in their forward; Falcon
and GPT-Neo, which pick their attention class from tables of their own, find an "upipe" entry
there, and Bloom's and MPT's ALiBi layers are routed to it (Falcon with ALiBi is refused by
name); a hand-written attention
in a model's own layer code is refused without advising register() (which it cannot use).
The compile-time refusal runs on a FAKE process group of P = 2 ranks."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from torch._dynamo.exc import BackendCompilerFailed  # noqa: E402

import upipe_compile  # noqa: E402
from upipe_compile import UnsupportedAttention  # noqa: E402
from upipe_compile.integrations.transformers import register  # noqa: E402

WORLD = 2


def _family(name: str):
    import transformers as tf

    small = dict(vocab_size=96)
    return {
        "falcon": (tf.FalconForCausalLM, lambda: tf.FalconConfig(**small, hidden_size=64, num_hidden_layers=2,
                                                                   num_attention_heads=4)),
        "gpt_neo": (tf.GPTNeoForCausalLM, lambda: tf.GPTNeoConfig(**small, hidden_size=64, num_layers=2, num_heads=4,
                                                                    attention_types=[[["global", "local"], 1]])),
        "mpt": (tf.MptForCausalLM, lambda: tf.MptConfig(**small, d_model=64, n_layers=2, n_heads=4)),
        "bloom": (tf.BloomForCausalLM, lambda: tf.BloomConfig(**small, hidden_size=64, n_layer=2, n_head=4)),
        "deepseek_v32": (tf.DeepseekV32ForCausalLM, lambda: tf.DeepseekV32Config(
            **small, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=32)),
        "doge": (tf.DogeForCausalLM, lambda: tf.DogeConfig(**small, hidden_size=64, num_hidden_layers=2,
                                                            num_attention_heads=4, num_key_value_heads=2,
                                                            intermediate_size=96)),
    }[name]


@pytest.mark.parametrize("name, model, why", [
    ("doge", "DogeForCausalLM", "dynamic attention mask"),
    ("deepseek_v32", "DeepseekV32ForCausalLM", "indexer"),
])
def test_building_with_register_names_the_model(name, model, why):
    cls, config = _family(name)
    config = config()
    config._attn_implementation = register()
    with pytest.raises(UnsupportedAttention) as info:
        cls(config)
    message = str(info.value)
    assert message.startswith(model) and why in message and "attention interface" in message, message
    config._attn_implementation = "eager"
    cls(config)  # their own attention still builds


def test_attention_in_a_models_own_code_is_refused_without_advising_register(world):
    cls, config = _family("bloom")
    config = config()
    config._attn_implementation = "eager"
    model = cls(config)
    ids = upipe_compile.shard_sequence(torch.randint(0, 96, (1, 16)), world)
    compiled = torch.compile(model, backend="upipe", options={"cp_mesh": world, "inner_backend": "eager"})
    with pytest.raises(BackendCompilerFailed) as info:
        compiled(input_ids=ids)
    message = str(info.value.inner_exception)
    assert "modeling_bloom.py" in message and "not through transformers' attention interface" in message, message
    assert "load the model with" not in message, message


def test_own_attention_families_build_with_register_and_falcon_alibi_is_refused():
    for name in ("falcon", "gpt_neo", "bloom", "mpt"):
        cls, config = _family(name)
        config = config()
        config._attn_implementation = register()
        cls(config)
    cls, config = _family("falcon")
    config = config()
    config.alibi = True
    config._attn_implementation = register()
    with pytest.raises(UnsupportedAttention, match=r"Falcon with ALiBi \(config.alibi=True\)"):
        cls(config)
