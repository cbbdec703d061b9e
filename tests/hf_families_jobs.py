"""transformers families whose attention is not plain causal SDPA, under backend="upipe":
Mistral (sliding window), Qwen2 (sliding-window layers), Gemma3 (mixed local/global layers,
QK-norm), Gemma2 (logit softcap, sliding layers), GPT-OSS (sinks, sliding layers). Tiny
models from their configs with seeded weights; module-level for spawned ranks."""

from __future__ import annotations

import contextlib
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import upipe_compile  # noqa: E402
from tests_support import attention_events  # noqa: E402
from upipe_compile.integrations.transformers import register  # noqa: E402

UPIPE_SDPA = register()
SEQ_LOCAL = 8
WINDOW = 6  # smaller than a shard at P = 2 (and crossing shards at P = 4)
CHUNK = 6  # Llama 4's attention chunks: a boundary inside a shard and chunks crossing shards at P = 2 and 4
COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, attention_dropout=0.0,
              tie_word_embeddings=False, use_cache=False)


def _config(family: str):
    import transformers as tf

    if family == "llama4":  # a chunked RoPE layer (chunks of 6 cross shards) and a NoPE layer with temperature
        return tf.Llama4ForCausalLM, tf.Llama4TextConfig(
            **COMMON, intermediate_size_mlp=96, attention_chunk_size=CHUNK, no_rope_layers=[1, 0],
            num_local_experts=2, num_experts_per_tok=1, interleave_moe_layer_step=2, attn_temperature_tuning=True,
            floor_scale=4, attn_scale=0.5)
    if family == "bloom":  # ALiBi written in its layer: slope * (key position)
        return tf.BloomForCausalLM, tf.BloomConfig(vocab_size=96, hidden_size=64, n_layer=2, n_head=4,
                                                   tie_word_embeddings=False, use_cache=False)
    if family == "mpt":  # ALiBi from its own slope table, QKV clipping
        return tf.MptForCausalLM, tf.MptConfig(vocab_size=96, d_model=64, n_layers=2, n_heads=4, max_seq_len=256,
                                               attn_config={"clip_qkv": 4.0}, tie_word_embeddings=False,
                                               use_cache=False)
    if family == "falcon":  # its own attention-class table; rotary, multi-query, parallel attention + MLP
        return tf.FalconForCausalLM, tf.FalconConfig(vocab_size=96, hidden_size=64, num_hidden_layers=2,
                                                     num_attention_heads=4, attention_dropout=0.0,
                                                     tie_word_embeddings=False, use_cache=False)
    if family == "gpt_neo":  # its own table; unscaled scores; a global and a local (windowed) layer
        return tf.GPTNeoForCausalLM, tf.GPTNeoConfig(vocab_size=96, hidden_size=64, num_layers=2, num_heads=4,
                                                     attention_types=[[["global", "local"], 1]],
                                                     window_size=WINDOW, max_position_embeddings=256,
                                                     tie_word_embeddings=False, use_cache=False)
    if family == "jetmoe":  # MoE attention and MLP: tokens gathered by expert, split by the host-read sizes
        common = {k: v for k, v in COMMON.items() if k != "head_dim"}
        return tf.JetMoeForCausalLM, tf.JetMoeConfig(**common, kv_channels=16, num_local_experts=4,
                                                     num_experts_per_tok=2)
    if family == "mixtral":  # MoE (token-choice routing) with a sliding window on every layer
        return tf.MixtralForCausalLM, tf.MixtralConfig(sliding_window=WINDOW, num_local_experts=4,
                                                       num_experts_per_tok=2, **COMMON)

    if family == "mistral":
        return tf.MistralForCausalLM, tf.MistralConfig(sliding_window=WINDOW, **COMMON)
    if family == "qwen2":
        return tf.Qwen2ForCausalLM, tf.Qwen2Config(use_sliding_window=True, sliding_window=WINDOW,
                                                   layer_types=["sliding_attention", "full_attention"], **COMMON)
    if family == "qwen3":  # a sliding-window layer and a full one, QK-norm
        return tf.Qwen3ForCausalLM, tf.Qwen3Config(use_sliding_window=True, sliding_window=WINDOW,
                                                   layer_types=["sliding_attention", "full_attention"], **COMMON)
    if family == "gemma3":
        return tf.Gemma3ForCausalLM, tf.Gemma3TextConfig(sliding_window=WINDOW,
                                                         layer_types=["sliding_attention", "full_attention"], **COMMON)
    if family == "gemma2":
        return tf.Gemma2ForCausalLM, tf.Gemma2Config(sliding_window=WINDOW, attn_logit_softcapping=2.0,
                                                     final_logit_softcapping=None, **COMMON)
    if family == "gpt_oss":
        return tf.GptOssForCausalLM, tf.GptOssConfig(sliding_window=WINDOW, num_local_experts=2,
                                                     num_experts_per_tok=1,
                                                     layer_types=["sliding_attention", "full_attention"], **COMMON)
    if family == "deepseek_v3":  # MLA (q/k head dim 24 = nope 16 + rope 8, v head dim 16) + MoE
        common = {k: v for k, v in COMMON.items() if k not in ("num_key_value_heads", "head_dim")}
        return tf.DeepseekV3ForCausalLM, tf.DeepseekV3Config(
            **common, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
            first_k_dense_replace=1, moe_intermediate_size=32, n_shared_experts=1)
    raise ValueError(family)


def build_model(family: str, attn_implementation: str, seed: int = 0, as_shipped: bool = False,
                experts_implementation: str | None = None):
    """Random fp32 weights from a seeded generator, identical on every process and for every
    attention implementation; larger than HF's init so attention is not near-uniform.
    ``as_shipped``: ``use_cache`` as the config class ships it (on, but for MPT) instead of off."""
    cls, config = _config(family)
    if experts_implementation is not None:
        config._experts_implementation = experts_implementation
    if as_shipped:
        config.use_cache = type(config)().use_cache  # on, but for MPT
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = cls(config).float()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(0.1 * noise if "gemma" in family else 1 + 0.1 * noise)  # Gemma norms scale by 1 + w
            elif p.dim() >= 2 and "embed_tokens" not in name:
                p.copy_(noise / p.shape[-1] ** 0.5)
                if family == "gpt_neo" and name.endswith(("q_proj.weight", "k_proj.weight")):
                    p.mul_(16 ** -0.25)  # GPT-Neo does not scale its scores: keep them as a scaled model's
            else:
                p.copy_(noise)
    model.train()
    return model


def make_inputs(world: int, seed: int = 0, seq_local: int = SEQ_LOCAL):
    gen = torch.Generator().manual_seed(seed + 2)
    seq = seq_local * world
    ids = torch.randint(0, COMMON["vocab_size"], (1, seq), generator=gen)
    dout = torch.randn(1, seq, COMMON["vocab_size"], generator=gen)
    return ids, dout


def _grads(model):
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def eager_reference(family: str, world: int, seq_local: int = SEQ_LOCAL, dtype: torch.dtype = torch.float32):
    """Uncompiled, unsharded, transformers' own "eager" attention (which implements the
    window through its mask, softcap and sinks by hand): (logits, param grads), the model
    and its inputs in ``dtype`` (float64: the exact values fp32 results are held to)."""
    # torch's grouped matmul takes no float64: the MoE families' expert loop does the same sums
    model = build_model(family, "eager", experts_implementation="eager" if dtype == torch.float64 else None).to(dtype)
    ids, dout = make_inputs(world, seq_local=seq_local)
    logits = model(input_ids=ids, use_cache=False).logits
    (logits * dout.to(dtype)).sum().backward()
    return logits.detach(), _grads(model)


def compiled_family_case(family: str, world: int, fuse: bool, as_shipped: bool = False):
    """This rank's shard through the model compiled with backend="upipe" (loaded with
    register()): (local logits, param grads, attention op counts of the second step).
    ``as_shipped``: the config's ``use_cache`` (on) and the call a training loop makes,
    ``model(input_ids=..., position_ids=...)``; the output must then carry no cache."""
    return _compiled_steps(build_model(family, UPIPE_SDPA, as_shipped=as_shipped), world, fuse, as_shipped)


def _compiled_steps(model, world: int, fuse: bool = True, as_shipped: bool = True):
    """Two steps of ``model`` compiled with backend="upipe" on this rank's shard (see
    :func:`compiled_family_case`)."""
    torch._dynamo.reset()
    assert dist.get_world_size() == world
    ids, dout = (upipe_compile.shard_sequence(t, dim=1) for t in make_inputs(world))
    positions = upipe_compile.global_positions(SEQ_LOCAL)
    compiled = torch.compile(model, backend="upipe",
                             options={"inner_backend": "aot_eager", "fuse_projections": fuse})
    use_cache = {} if as_shipped else {"use_cache": False}

    def step():
        out = compiled(input_ids=ids, position_ids=positions, **use_cache)
        assert out.cache is None, f"a cache of this rank's shard came back: {type(out.cache).__name__}"
        (out.logits * dout).sum().backward()
        return out.logits.detach()

    step()
    model.zero_grad(set_to_none=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        logits = step()
    return logits, _grads(model), dict(attention_events(prof))


DOCUMENT_LENGTHS = (5, 1, 10)  # a packed row over SEQ_LOCAL * 2: one document of length 1, one crossing ranks


def eager_documents_reference(family: str, world: int = 2, seq_local: int = SEQ_LOCAL,
                              lengths: tuple[int, ...] = DOCUMENT_LENGTHS):
    """Each document of the packed row through the unsharded eager model on its own."""
    from tests_support import per_document_logits

    model = build_model(family, "eager")
    ids, dout = make_inputs(world, seq_local=seq_local)
    logits = per_document_logits(model, ids, dout, lengths)
    return logits, _grads(model)


def compiled_packed_case(family: str, world: int):
    """The packed row through the compiled model on this rank's shard (register()'s
    packed_batch): (logits, grads)."""
    from upipe_compile.integrations.transformers import packed_batch

    torch._dynamo.reset()
    model = build_model(family, UPIPE_SDPA)
    ids, dout = make_inputs(2)
    positions = torch.cat([torch.arange(n) for n in DOCUMENT_LENGTHS]).unsqueeze(0)
    batch = packed_batch(ids, positions)
    dout = upipe_compile.shard_sequence(dout, dim=1)
    compiled = torch.compile(model, backend="upipe", options={"inner_backend": "aot_eager"})
    logits = compiled(**batch, use_cache=False).logits
    (logits * dout).sum().backward()
    return logits.detach(), _grads(model)


def mesh_family_case(family: str, ring: int, seq_local: int = SEQ_LOCAL, lengths: tuple[int, ...] | None = None):
    """The family compiled over a ("cp_ring", "cp_a2a") mesh of ``ring`` x world/ring ranks
    with the layout's own positions (``lengths``: packed documents' positions, restarting at
    each, in the layout's order): (full logits gathered in order, param grads)."""
    from torch.distributed.device_mesh import init_device_mesh

    from upipe_compile.sharding import gather_sequence, shard_sequence

    torch._dynamo.reset()
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (ring, world // ring), mesh_dim_names=("cp_ring", "cp_a2a"))
    model = build_model(family, UPIPE_SDPA)
    ids, dout = (shard_sequence(t, mesh, dim=1) for t in make_inputs(world, seq_local=seq_local))
    positions = upipe_compile.global_positions(ids.shape[1], mesh)
    if lengths is not None:
        positions = shard_sequence(torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0), mesh, dim=1)
    compiled = torch.compile(model, backend="upipe", options={"cp_mesh": mesh, "inner_backend": "aot_eager"})
    logits = compiled(input_ids=ids, position_ids=positions, use_cache=False).logits
    (logits * dout).sum().backward()
    return gather_sequence(logits.detach(), mesh, dim=1), _grads(model)


def past_refusal_case(family: str, keyword: str) -> str:
    """The compiled model handed a past (an empty cache, as generate() hands one to its first
    forward) under context parallelism: the error's message (it must be raised)."""
    from transformers import DynamicCache

    from upipe_compile.errors import UnsupportedAttention

    torch._dynamo.reset()
    model = build_model(family, UPIPE_SDPA, as_shipped=True)
    ids = upipe_compile.shard_sequence(make_inputs(dist.get_world_size())[0], dim=1)
    compiled = torch.compile(model, backend="upipe", options={"inner_backend": "aot_eager"})
    try:
        compiled(input_ids=ids, position_ids=upipe_compile.global_positions(SEQ_LOCAL),
                 **{keyword: DynamicCache(config=model.config)})
    except UnsupportedAttention as error:
        return str(error)
    raise AssertionError(f"{family} ran with {keyword}= under context parallelism")


def cache_refusal_case(family: str) -> str:
    """A sliding-window model that missed register()'s cache hook (built before register(),
    switched to its attention later) called with its cache on under context parallelism:
    the refusal's message (it must be raised)."""
    from torch._dynamo.exc import BackendCompilerFailed

    torch._dynamo.reset()
    model = build_model(family, UPIPE_SDPA, as_shipped=True)
    for module in model.modules():  # as a model built before register() has none
        module._forward_pre_hooks.clear()
    ids = upipe_compile.shard_sequence(make_inputs(dist.get_world_size())[0], dim=1)
    compiled = torch.compile(model, backend="upipe", options={"inner_backend": "aot_eager"})
    try:
        compiled(input_ids=ids, position_ids=upipe_compile.global_positions(SEQ_LOCAL))
    except BackendCompilerFailed as error:
        return str(error.inner_exception)
    raise AssertionError(f"{family} filled its sliding-window cache under context parallelism")


@contextlib.contextmanager
def _built_before_register():
    """Models built inside it get ``post_init`` as it was before register() (no cache hook): this
    process has called register() already (importing this module does)."""
    from transformers import PreTrainedModel

    hooked = PreTrainedModel.post_init
    PreTrainedModel.post_init = getattr(hooked, "__wrapped__", hooked)
    try:
        yield
    finally:
        PreTrainedModel.post_init = hooked


# transformers builds Gemma2 and GPT-OSS with eager attention only (no SDPA support declared)
BUILT_WITH = {"gemma2": "eager", "gpt_oss": "eager"}


def switched_family_case(family: str, world: int):
    """A model built with SDPA before register() (at the config's defaults: use_cache on), then
    switched with ``model.set_attn_implementation(register())``, transformers' documented switch,
    compiled with backend="upipe" and called as a training loop calls it: (local logits, param
    grads, attention op counts of the second step); the output must carry no cache."""
    with _built_before_register():
        model = build_model(family, BUILT_WITH.get(family, "sdpa"), as_shipped=True)
    assert model.config.use_cache and not any(m._forward_pre_hooks for m in model.modules()), "not as built before"
    model.set_attn_implementation(register())
    return _compiled_steps(model, world)
