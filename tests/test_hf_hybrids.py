"""Never silent: a hybrid layer whose mixer upipe does not run as a stage loop is refused under
backend="upipe" with P > 1, naming the mixer's line in the model's source; the mixer would
otherwise run over this rank's shard alone (a silent wrong answer). MiniMax's lightning
attention is written inline in its layer; the Mamba and Mamba2 families are run here with their
own, unrouted mixer functions (as a family upipe does not know would be). Routed, they run
exactly: tests/test_hf_hybrid_numerics.py. Tiny configs of transformers' own classes, loaded
with register(), on a FAKE process group of P = 2 ranks (the refusal happens at compile time,
before anything runs)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from torch._dynamo.exc import BackendCompilerFailed  # noqa: E402

import upipe_compile  # noqa: E402
from upipe_compile import UnsupportedAttention  # noqa: E402
from upipe_compile.integrations.transformers import register  # noqa: E402
from upipe_compile.integrations.transformers_mixers import original_mixers  # noqa: E402

WORLD = 2
COMMON = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              use_cache=False, tie_word_embeddings=False)


def _family(name: str):
    import transformers as tf

    if name == "qwen3_next":  # Gated DeltaNet after a causal conv1d, MoE
        return tf.Qwen3NextForCausalLM, tf.Qwen3NextConfig(
            **COMMON, head_dim=16, intermediate_size=96, layer_types=["linear_attention", "full_attention"],
            linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
            num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    if name == "jamba":  # Mamba (selective scan), MoE
        return tf.JambaForCausalLM, tf.JambaConfig(**COMMON, intermediate_size=96, attn_layer_period=2,
                                                   attn_layer_offset=1, expert_layer_period=2, num_experts=2,
                                                   mamba_d_state=8, mamba_expand=2)
    if name == "falcon_h1":  # Mamba2 (SSD) beside attention in every layer
        return tf.FalconH1ForCausalLM, tf.FalconH1Config(**COMMON, head_dim=16, intermediate_size=96, mamba_d_ssm=64,
                                                         mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1,
                                                         mamba_d_state=8, mamba_chunk_size=8)
    if name == "bamba":  # Mamba2 layers and attention layers
        return tf.BambaForCausalLM, tf.BambaConfig(**COMMON, intermediate_size=96, attn_layer_indices=[1],
                                                   mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=1,
                                                   mamba_d_state=8, mamba_chunk_size=8)
    if name == "lfm2":  # gated short conv
        return tf.Lfm2ForCausalLM, tf.Lfm2Config(**COMMON, layer_types=["conv", "full_attention"])
    if name == "minimax":  # lightning (linear) attention, MoE
        return tf.MiniMaxForCausalLM, tf.MiniMaxConfig(**COMMON, head_dim=16, intermediate_size=96,
                                                       layer_types=["linear_attention", "full_attention"],
                                                       num_local_experts=2, num_experts_per_tok=1, block_size=8)
    raise ValueError(name)


# the model file and a piece of the mixer's line the refusal must name
HYBRIDS = [
    ("jamba", "modeling_jamba.py", "F.conv1d("),
    ("falcon_h1", "modeling_falcon_h1.py", "F.conv1d("),
    ("bamba", "modeling_bamba.py", "F.conv1d("),
    ("minimax", "modeling_minimax.py", "torch.matmul(current_query_states, current_key_states"),
]


@pytest.mark.parametrize("name, file, code", HYBRIDS, ids=[h[0] for h in HYBRIDS])
def test_hybrid_family_is_refused_naming_its_mixer(world, name, file, code):
    cls, config = _family(name)
    config._attn_implementation = register()
    torch.manual_seed(0)
    model = cls(config)
    ids = upipe_compile.shard_sequence(torch.randint(0, 96, (1, 16)), world)
    positions = upipe_compile.global_positions(ids.shape[1], world)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="upipe", options={"cp_mesh": world, "inner_backend": "eager"})
    with pytest.raises(BackendCompilerFailed) as info, original_mixers():
        compiled(input_ids=ids, position_ids=positions)
    inner = info.value.inner_exception
    assert type(inner) is UnsupportedAttention, repr(inner)
    message = str(inner)
    assert "mix tokens across the sharded sequence" in message, message
    mixer_lines = [line for line in message.splitlines() if file in line]
    assert any(code in line for line in mixer_lines), message
    assert "attention call(s)" not in message  # the softmax attention layers are rewritten, not refused

