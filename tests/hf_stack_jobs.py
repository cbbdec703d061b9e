"""UPipeTrainer with the long-context stack (upipe_compile.integrations.hf_stack) on P gloo
ranks, and the stock transformers Trainer on one process: tiny seeded fp32 Llama, Qwen3, a
sliding-window family, a MoE and a hybrid, configs as shipped but for their sizes (use_cache on),
SGD, gradient accumulation 2.
Module-level for spawned RankPool workers."""

from __future__ import annotations

import contextlib
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from hf_trainer_jobs import _Record, _common, _distributed_env, _reset_accelerate, _result, lm_dataset  # noqa: E402

VOCAB, HIDDEN, INTERMEDIATE = 100, 32, 80  # distinct from every other dim (the hybrid mixer's too): a last dim says what it is
SEQ = 64  # 2 rows x 64 / P = 2: 64 local tokens a micro-batch
SAMPLES = 8  # 2 optimizer steps of 2 micro-batches of 2 rows
INNER = {"inner_backend": "aot_eager"}


FAMILIES = {  # beyond Llama / Qwen3: the family's test config (tests/hf_families_jobs.py, hf_hybrids_jobs.py)
    "mistral": "hf_families_jobs",  # sliding window on every layer
    "mixtral": "hf_families_jobs",  # MoE with a sliding window
    "qwen3_next": "hf_hybrids_jobs",  # hybrid: Gated DeltaNet + full attention, MoE
}


def build_model(family: str = "llama", **overrides):
    """The family's config class as shipped (use_cache on, untied head), tiny; seeded weights
    scaled like a trained model's so that attention and the MLP are not near-uniform."""
    import importlib

    import transformers as tf

    if family in FAMILIES:
        cls, config = importlib.import_module(FAMILIES[family])._config(family)
        config.use_cache = type(config)().use_cache
        for key, value in {"vocab_size": VOCAB, "intermediate_size": INTERMEDIATE, **overrides}.items():
            setattr(config, key, value)
    else:
        sizes = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256)
        cls, config_cls = {"llama": (tf.LlamaForCausalLM, tf.LlamaConfig),
                           "qwen3": (tf.Qwen3ForCausalLM, tf.Qwen3Config)}[family]
        config = config_cls(**{**sizes, **overrides})
    assert config.use_cache and config.num_hidden_layers == 2
    config._attn_implementation = "eager" if family in FAMILIES else "sdpa"
    torch.manual_seed(0)
    model = cls(config).float()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1 + 0.1 * noise)
            elif p.dim() >= 2:
                p.copy_(noise / p.shape[-1] ** 0.5)
            else:  # the hybrids' decay and step biases: small, as trained ones
                p.copy_(0.1 * noise if family in FAMILIES else noise)
    return model


def _evidence(prof, trainer) -> dict:
    """What the profiler saw (every aten op, inside custom ops and compiled graphs too, with input
    shapes): the most rows of any [rows, vocab] and [rows, intermediate] input, the tiled-MLP
    calls; and what the offloader moved in the last step."""
    rows = {"logit_rows": 0, "mlp_rows": 0}
    calls = 0
    for event in prof.events():
        calls += event.name == "upipe::tiled_swiglu"
        for shape in event.input_shapes or ():
            if isinstance(shape, list) and len(shape) >= 2 and all(isinstance(n, int) for n in shape):
                n = 1
                for d in shape[:-1]:
                    n *= d
                key = {VOCAB: "logit_rows", INTERMEDIATE: "mlp_rows"}.get(shape[-1])
                if key:
                    rows[key] = max(rows[key], n)
    model = trainer.accelerator.unwrap_model(trainer.model)
    offloader = getattr(model, "upipe_offloader", None)
    host = None
    if offloader is not None:
        buffers = [offloader.host_buffer(i) for i in range(len(offloader.blocks))]
        host = {"offloaded": offloader.offloaded_last_step, "bytes": offloader.offloaded_bytes_last_step,
                "buffers": [None if b is None else (str(b.device), tuple(b.shape)) for b in buffers]}
    from tests_support import attention_events

    return {**rows, "tiled_calls": calls, "host": host, "ops": dict(attention_events(prof))}


def run(upipe: bool, family: str = "llama", gradient_checkpointing: bool = False, profile: bool = True,
        seq: int = SEQ, **stack):
    """Train; returns (logged losses, final parameters[, evidence with ``upipe``]). ``stack``:
    UPipeTrainer's keywords (loss_chunk_tokens, mlp_tile_tokens, offload_block_inputs,
    keep_attention, host_memory_reserve_gib)."""
    from transformers import Trainer, TrainingArguments, default_data_collator

    _reset_accelerate()
    if upipe:
        _distributed_env()
    try:
        model = build_model(family)
        data = lm_dataset(SAMPLES, seq, VOCAB)
        record = _Record()
        with tempfile.TemporaryDirectory() as out:
            args = TrainingArguments(**_common(out), gradient_checkpointing=gradient_checkpointing)
            kwargs = dict(model=model, args=args, train_dataset=data, data_collator=default_data_collator,
                          callbacks=[record])
            if not upipe:
                trainer = Trainer(**kwargs)
                from upipe_compile.integrations.transformers_mixers import original_mixers

                # the reference runs a hybrid's own mixer functions
                with original_mixers() if family == "qwen3_next" else contextlib.nullcontext():
                    trainer.train()
                return _result(trainer, record)
            from upipe_compile.integrations.hf_trainer import UPipeTrainer

            trainer = UPipeTrainer(**kwargs, upipe_options=INNER, **stack)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                        record_shapes=profile) as prof:
                trainer.train()
            return (*_result(trainer, record), _evidence(prof, trainer) if profile else None)
    finally:
        _reset_accelerate()


def refusals() -> list:
    """Each refused set-up through UPipeTrainer on this pool's ranks: (case, error chain)."""
    from hf_trainer_jobs import refused

    cases = {
        "offload without checkpointing": dict(offload_block_inputs=True),
        "host memory": dict(offload_block_inputs=True, gradient_checkpointing=True, host_memory_reserve_gib=1e9),
        "bad tile": dict(mlp_tile_tokens=-4),
    }
    return [(case, refused(run, True, profile=False, **kw)) for case, kw in cases.items()]


def run_sft(upipe: bool, family: str = "llama", **stack):
    """TRL's SFTTrainer, padding-free packing (its default gradient checkpointing on); returns
    (logged losses, final parameters[, evidence with ``upipe``])."""
    from trl import SFTConfig, SFTTrainer

    from hf_trainer_jobs import sft_dataset, tokenizer

    _reset_accelerate()
    if upipe:
        _distributed_env()
    try:
        record = _Record()
        with tempfile.TemporaryDirectory() as out:
            args = SFTConfig(**_common(out), padding_free=True, pad_to_multiple_of=48, bf16=False, max_length=None,
                             dataset_num_proc=None)
            kwargs = dict(model=build_model(family), args=args, train_dataset=sft_dataset(12, VOCAB),
                          processing_class=tokenizer(VOCAB), callbacks=[record])
            if not upipe:
                trainer = SFTTrainer(**kwargs)
                trainer.train()
                return _result(trainer, record)
            from upipe_compile.integrations.hf_trainer import UPipeSFTTrainer

            trainer = UPipeSFTTrainer(**kwargs, upipe_options=INNER, **stack)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
                trainer.train()
            return (*_result(trainer, record), _evidence(prof, trainer))
    finally:
        _reset_accelerate()
