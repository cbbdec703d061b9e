"""Hybrid transformers families whose mixers upipe runs as stage loops (Qwen3-Next's short
conv and gated delta rule, LFM2's gated short conv), on gloo ranks against the unsharded
model with the families' own mixer functions. Module-level for spawned ranks."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import upipe_compile  # noqa: E402
from upipe_compile.integrations.transformers import register  # noqa: E402
from tests_support import per_document_logits  # noqa: E402
from upipe_compile.integrations.transformers_mixers import original_mixers  # noqa: E402

UPIPE = register()
SEQ = 32  # full sequence: longer than Qwen3-Next's chunk (rounded to 64 internally) at P = 4 too
VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              use_cache=False, tie_word_embeddings=False)

# the families whose mixers upipe routes, one of each mixer kind and layout
FAMILIES = ["qwen3_next", "qwen3_5", "olmo_hybrid", "lfm2", "bamba", "falcon_h1", "jamba", "minimax"]


def _config(family: str):
    import transformers as tf

    if family == "qwen3_next":
        return tf.Qwen3NextForCausalLM, tf.Qwen3NextConfig(
            **COMMON, head_dim=16, intermediate_size=96, layer_types=["linear_attention", "full_attention"],
            linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    if family == "qwen3_5":  # the same Gated DeltaNet layer, dense MLP
        return tf.Qwen3_5ForCausalLM, tf.Qwen3_5TextConfig(
            **COMMON, head_dim=16, intermediate_size=96, layer_types=["linear_attention", "full_attention"],
            linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16)
    if family == "olmo_hybrid":  # Gated DeltaNet with its own projections and gate
        return tf.OlmoHybridForCausalLM, tf.OlmoHybridConfig(
            **COMMON, intermediate_size=96, layer_types=["linear_attention", "full_attention"], pad_token_id=0,
            eos_token_id=1, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
            linear_value_head_dim=16)
    if family == "lfm2":
        return tf.Lfm2ForCausalLM, tf.Lfm2Config(**COMMON, layer_types=["conv", "full_attention"])
    if family == "bamba":  # Mamba2: 8 heads in 2 groups of B/C, chunks shorter than a shard
        return tf.BambaForCausalLM, tf.BambaConfig(**COMMON, intermediate_size=96, attn_layer_indices=[1],
                                                   mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2,
                                                   mamba_d_state=8, mamba_chunk_size=4)
    if family == "falcon_h1":  # Mamba2 beside attention in every layer, one group of B/C
        return tf.FalconH1ForCausalLM, tf.FalconH1Config(**COMMON, head_dim=16, intermediate_size=96, mamba_d_ssm=64,
                                                         mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1,
                                                         mamba_d_state=8, mamba_chunk_size=8)
    if family == "jamba":  # Mamba (selective scan; B and C shared by every channel), MoE
        return tf.JambaForCausalLM, tf.JambaConfig(**COMMON, intermediate_size=96, attn_layer_period=2,
                                                   attn_layer_offset=1, expert_layer_period=2, num_experts=2,
                                                   mamba_d_state=8, mamba_expand=2)
    if family == "minimax":  # lightning attention (blocks of 6: a partial last one), MoE
        return tf.MiniMaxForCausalLM, tf.MiniMaxConfig(**COMMON, head_dim=16, intermediate_size=96,
                                                       layer_types=["linear_attention", "full_attention"],
                                                       num_local_experts=4, num_experts_per_tok=2, block_size=6)
    raise ValueError(family)


def build_model(family: str, attn_implementation: str, as_shipped: bool = False):
    """``as_shipped``: ``use_cache`` as the config class ships it (on) instead of off."""
    cls, config = _config(family)
    if as_shipped:
        config.use_cache = type(config)().use_cache
        assert config.use_cache, f"{family} ships with use_cache off: the as-shipped case would test nothing"
    config._attn_implementation = attn_implementation
    torch.manual_seed(0)
    model = cls(config).float()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1 + 0.1 * noise)
            elif p.dim() >= 2 and "embed_tokens" not in name:
                p.copy_(noise / p.shape[-1] ** 0.5)
            else:
                p.copy_(0.1 * noise)
    model.train()
    return model


def make_inputs():
    gen = torch.Generator().manual_seed(2)
    return torch.randint(0, VOCAB, (1, SEQ), generator=gen), torch.randn(1, SEQ, VOCAB, generator=gen)


def _grads(model):
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def eager_reference(family: str):
    """Unsharded, uncompiled, the family's own mixer functions and eager attention."""
    with original_mixers():
        model = build_model(family, "eager")
        ids, dout = make_inputs()
        logits = model(input_ids=ids, use_cache=False).logits
        (logits * dout).sum().backward()
    return logits.detach(), _grads(model)


def compiled_case(family: str, world: int, heads_per_stage: int | None = None, as_shipped: bool = False):
    """This rank's shard through the model compiled with backend="upipe": (logits, grads,
    names of the upipe ops in the graphs). ``as_shipped``: the config's ``use_cache`` (on)
    and the call a training loop makes, ``model(input_ids=..., position_ids=...)``; the
    output must then carry no cache (its conv and SSM states would be this rank's shard's)."""
    torch._dynamo.reset()
    assert dist.get_world_size() == world
    model = build_model(family, UPIPE, as_shipped)
    ids, dout = (upipe_compile.shard_sequence(t, dim=1) for t in make_inputs())
    positions = upipe_compile.global_positions(ids.shape[1])
    ops = set()

    def backend(gm, example_inputs):
        options = {"inner_backend": "eager"} | ({} if heads_per_stage is None else {"heads_per_stage": heads_per_stage})
        compiled = upipe_compile.upipe_backend(gm, example_inputs, options=options)
        ops.update(str(n.target) for m in gm.modules() if hasattr(m, "graph") for n in m.graph.nodes
                   if "upipe" in str(n.target))
        return compiled

    out = torch.compile(model, backend=backend)(input_ids=ids, position_ids=positions,
                                                **({} if as_shipped else {"use_cache": False}))
    assert out.cache is None, f"a cache of this rank's shard came back: {type(out.cache).__name__}"
    (out.logits * dout).sum().backward()
    return out.logits.detach(), _grads(model), sorted(ops)


DOCUMENT_LENGTHS = (11, 5, 16)  # a packed row of three documents over the full SEQ = 32


def packed_positions():
    return torch.cat([torch.arange(n) for n in DOCUMENT_LENGTHS]).unsqueeze(0)


def eager_documents_reference(family: str):
    """Each document through the unsharded eager model on its own (what restarting the mixers
    and attention at document boundaries must equal): (logits, grads)."""
    with original_mixers():
        model = build_model(family, "eager")
        ids, dout = make_inputs()
        logits = per_document_logits(model, ids, dout, DOCUMENT_LENGTHS)
    return logits, _grads(model)


def eager_packed_reference(family: str):
    """The packed row through the unsharded eager model, as transformers runs it (for families
    whose mixers it gives no document boundaries): (logits, grads)."""
    with original_mixers():
        model = build_model(family, "eager")
        ids, dout = make_inputs()
        logits = model(input_ids=ids, position_ids=packed_positions(), use_cache=False).logits
        (logits * dout).sum().backward()
    return logits.detach(), _grads(model)


def compiled_packed_case(family: str, world: int):
    """The packed row through the compiled model on this rank's shard (register()'s
    packed_batch: boundaries over the full sequence): (logits, grads, upipe ops)."""
    from upipe_compile.integrations.transformers import packed_batch

    torch._dynamo.reset()
    model = build_model(family, UPIPE)
    ids, dout = make_inputs()
    batch = packed_batch(ids, packed_positions())
    dout = upipe_compile.shard_sequence(dout, dim=1)
    ops = set()

    def backend(gm, example_inputs):
        compiled = upipe_compile.upipe_backend(gm, example_inputs, options={"inner_backend": "eager"})
        ops.update(str(n.target) for m in gm.modules() if hasattr(m, "graph") for n in m.graph.nodes
                   if "upipe" in str(n.target))
        return compiled

    logits = torch.compile(model, backend=backend)(**batch, use_cache=False).logits
    (logits * dout).sum().backward()
    return logits.detach(), _grads(model), sorted(ops)


def uneven_case(family: str):
    """Step 1 both ranks at 16 tokens, step 2 rank 1 at 20: per step "ok" or this rank's error."""
    torch._dynamo.reset()
    model = build_model(family, UPIPE)
    compiled = torch.compile(model, backend="upipe", options={"inner_backend": "eager"})
    outcomes = []
    for lengths in ([16, 16], [16, 20]):
        seq_local = lengths[dist.get_rank()]
        ids = torch.randint(0, VOCAB, (1, seq_local), generator=torch.Generator().manual_seed(seq_local))
        try:
            compiled(input_ids=ids, position_ids=upipe_compile.global_positions(seq_local),
                     use_cache=False).logits.sum().backward()
            outcomes.append("ok")
        except upipe_compile.UnsupportedAttention as error:
            outcomes.append(str(error))
    return outcomes
