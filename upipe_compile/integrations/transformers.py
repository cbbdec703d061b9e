"""Hugging Face transformers models under backend="upipe".

With ``attn_implementation="sdpa"``, transformers 5.x materialises a boolean causal mask
under torch.compile even when no ``attention_mask`` is given (it cannot prove "no packed
sequences" from ``position_ids`` while tracing), so SDPA receives ``attn_mask=<local mask>``
and upipe refuses it — rightly: that mask covers the local shard only.

:func:`register` adds an attention implementation, ``"upipe"``, through transformers'
own extension points (a name without "sdpa": transformers refuses SDPA-named
implementations for models it has no SDPA support for, such as Gemma2 and GPT-OSS):

- attention: the stock SDPA attention function, or, when the model is called with document
  boundaries ``cu_seq_lens_q`` (transformers' name for them, as
  ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` produces them for
  flash_attention_2), :func:`upipe_compile.document_sdpa` with those boundaries, which the
  upipe pass rewrites into UPipe. Boundaries are made once per step (:func:`packed_batch`
  makes them from the full sequence's position_ids), never per layer.
- without ``cu_seq_lens_q``, the per-layer ``position_ids`` (this rank's shard) stand for the
  boundaries: a document starts wherever a position is not the previous one + 1, read by
  the op from all ranks' positions once per step. Positions counting straight through are
  one causal sequence (the dense kernels, as plain SDPA); positions restarting per document
  (``DataCollatorWithFlattening`` without flash kwargs) never attend across documents.
- attention variants: the ``sliding_window`` (transformers counts the query itself:
  ``window=(w - 1, w - 1)``), ``softcap`` and ``s_aux`` (sinks) keywords models pass go to
  :func:`upipe_compile.document_sdpa`, per layer (Gemma3 and GPT-OSS mix windowed and full
  layers). Any other keyword is refused, never dropped.
- chunked attention (Llama 4's ``attention_chunk_size``): the mask function returns
  :class:`ChunkedMask`, and the layer's positions modulo the chunk size go to
  :func:`upipe_compile.document_sdpa` as packed documents (chunks may cross shards).
- the cache: under context parallelism a forward from no past runs with ``use_cache=False``
  (a cache would hold this rank's shard), and one handed a past is refused (a forward
  pre-hook on every model built after register(), and on a model built before it once
  switched with ``model.set_attn_implementation(register())``).
- mask: None when there is no padding (SDPA then gets ``is_causal=True``,
  ``enable_gqa=True``, which upipe rewrites), including an all-ones ``attention_mask``
  (checked once per step, outside the compiled graph). A real padding mask goes to
  transformers' SDPA mask, so upipe refuses it at compile time instead of dropping it.

    from upipe_compile.integrations.transformers import register, packed_batch
    model = LlamaForCausalLM.from_pretrained(..., attn_implementation=register())
    logits = torch.compile(model, backend="upipe")(**packed_batch(ids, position_ids)).logits
"""

from __future__ import annotations

import logging

import torch

from upipe_compile.integrations.transformers_attention import (
    ATTN_IMPLEMENTATION, _causal_sdpa_mask, _context_parallel, _upipe_attention_forward,
)

log = logging.getLogger(__name__)

# The keywords a past arrives under (transformers 5.24 renamed past_key_values and
# cache_params to cache and still accepts the old names).
_PAST_KEYWORDS = ("cache", "past_key_values", "cache_params")


@torch._dynamo.assume_constant_result
def _note_cache_off(model: str) -> bool:
    """One log line per model class, at trace time (Dynamo runs this while compiling)."""
    if model not in _CACHE_OFF_NOTED:
        _CACHE_OFF_NOTED.add(model)
        log.info("upipe: %s runs with use_cache=False under context parallelism: its cache would hold this "
                 "rank's shard of the sequence only, so the forward returns none", model)
    return True


_CACHE_OFF_NOTED: set[str] = set()


def _no_cache_under_context_parallelism(model, args, kwargs):
    """Forward pre-hook of register()'s models: a forward from no past (training,
    evaluation, a plain ``model(input_ids)``) runs with ``use_cache=False`` under context
    parallelism, whatever the config says: a cache filled from one rank's shard is wrong for
    generation, and a sliding-window or hybrid cache's update reads the sequence as no other
    op of the forward does. A forward handed a past is refused (generation reads it)."""
    if getattr(model.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION or not _context_parallel():
        return None
    past = [name for name in _PAST_KEYWORDS if kwargs.get(name) is not None]
    if past:
        from upipe_compile.errors import UnsupportedAttention

        raise UnsupportedAttention(
            f"{type(model).__name__} was called with {past[0]}= under context parallelism: a cache holds one "
            "rank's shard of the sequence, so generation and a forward that continues from a past cannot run "
            "sequence-sharded. Generate with the model uncompiled (or compiled with another backend): with "
            "register()'s attention it then attends over each rank's whole input")
    if kwargs.get("use_cache") is False or (kwargs.get("use_cache") is None
                                            and not getattr(model.config, "use_cache", False)):
        return None
    _note_cache_off(type(model).__name__)
    return args, {**kwargs, "use_cache": False}


_CACHE_HOOKED = "_upipe_cache_hooked"


def prepare_model(model) -> None:
    """Give ``model`` and each transformers model inside it the cache hook (once each), and mark
    its own-attention layers when it runs register()'s attention. Models built after register()
    get this from ``post_init``; a model built before it, when switched with
    ``model.set_attn_implementation(register())``."""
    from transformers import PreTrainedModel

    from upipe_compile.integrations.transformers_own_attention import mark_own_attention_layers

    for module in model.modules():
        if isinstance(module, PreTrainedModel) and not getattr(module, _CACHE_HOOKED, False):
            module.register_forward_pre_hook(_no_cache_under_context_parallelism, with_kwargs=True)
            setattr(module, _CACHE_HOOKED, True)
    if getattr(model.config, "_attn_implementation", None) == ATTN_IMPLEMENTATION:
        mark_own_attention_layers(model)  # Bloom's, MPT's ALiBi attention


def _hooking_post_init(post_init):
    """``PreTrainedModel.post_init`` that also prepares each model it builds."""

    def hooked_post_init(self):
        post_init(self)
        prepare_model(self)

    hooked_post_init.__upipe_hook__ = True
    hooked_post_init.__wrapped__ = post_init
    return hooked_post_init


def _hooking_set_attn_implementation(set_attn_implementation):
    """``PreTrainedModel.set_attn_implementation`` that also prepares the model it switches: a
    model built before register() has no cache hook, and under context parallelism its cache
    (on by the config's default) would hold this rank's shard."""

    def switching_set_attn_implementation(self, *args, **kwargs):
        set_attn_implementation(self, *args, **kwargs)
        prepare_model(self)

    switching_set_attn_implementation.__upipe_hook__ = True
    switching_set_attn_implementation.__wrapped__ = set_attn_implementation
    return switching_set_attn_implementation


def _hook_every_new_model() -> None:
    """Prepare every model built from now on, and every model switched to another attention."""
    from transformers import PreTrainedModel

    if not getattr(PreTrainedModel.post_init, "__upipe_hook__", False):
        PreTrainedModel.post_init = _hooking_post_init(PreTrainedModel.post_init)
    if not getattr(PreTrainedModel.set_attn_implementation, "__upipe_hook__", False):
        PreTrainedModel.set_attn_implementation = _hooking_set_attn_implementation(
            PreTrainedModel.set_attn_implementation)


def register() -> str:
    """Register ``"upipe"`` with transformers (idempotent) and return the name."""
    from transformers import AttentionInterface, AttentionMaskInterface

    from upipe_compile.integrations.transformers_mixers import route_mixers
    from upipe_compile.integrations.transformers_own_attention import route_own_attention_tables

    AttentionInterface.register(ATTN_IMPLEMENTATION, _upipe_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _causal_sdpa_mask)
    route_mixers()  # hybrid layers' convs and gated delta rules: upipe::head_mixer
    route_own_attention_tables()  # Falcon, GPT-Neo: an "upipe" entry in their attention tables
    _hook_every_new_model()  # no cache under context parallelism, built now or switched later
    _refuse_in_own_attention_tables()
    return ATTN_IMPLEMENTATION


# Decoder families whose attention register() cannot reach: they read the mask as a tensor
# themselves (Doge's dynamic mask, DeepSeek-V3.2's sparse attention). (Bloom's and MPT's ALiBi
# layers are routed to it: transformers_own_attention.py.) (Falcon and
# GPT-Neo, which pick their class from a table of their own, get an "upipe" entry there:
# transformers_own_attention.py.)
OWN_ATTENTION = {"doge": "builds its dynamic attention mask from the mask tensor itself",
                 # sparse attention: a learned indexer picks each query's keys from the mask tensor
                 "deepseek_v32": "picks each query's keys with its indexer, from the mask tensor itself",
                 "axk2": "picks each query's keys with its indexer, from the mask tensor itself",
                 "glm_moe_dsa": "picks each query's keys with its indexer, from the mask tensor itself",
                 "hy_v4": "picks each query's keys with its indexer, from the mask tensor itself"}


def _refuse_in_own_attention_tables() -> None:
    """Make building such a model with ``attn_implementation="upipe"`` refuse by name (instead
    of a KeyError, or a crash on the mask in its forward): a refusing ``"upipe"`` entry in its
    attention table, and a check at the end of its ``__init__`` (``post_init``)."""
    import importlib

    for family, why in OWN_ATTENTION.items():
        try:
            module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        except ImportError:
            continue
        for name, value in list(vars(module).items()):
            if name.endswith("_ATTENTION_CLASSES") and isinstance(value, dict):
                value.setdefault(ATTN_IMPLEMENTATION, _refusal(family, why))
            elif name.endswith("PreTrainedModel") and isinstance(value, type) and "post_init" not in vars(value):
                value.post_init = _refusing_post_init(family, why)


def _refusing_post_init(family: str, why: str):
    from transformers import PreTrainedModel

    def post_init(self):
        if getattr(self.config, "_attn_implementation", None) == ATTN_IMPLEMENTATION:
            _refusal(family, why, type(self).__name__)(self.config)
        PreTrainedModel.post_init(self)

    return post_init


def _refusal(family: str, why: str, model: str | None = None):
    def refuse(config, *args, **kwargs):
        import importlib

        from upipe_compile.errors import UnsupportedAttention, display_path

        name = _model_being_built() or model or f"the {family} model"
        source = display_path(importlib.import_module(f"transformers.models.{family}.modeling_{family}").__file__)
        raise UnsupportedAttention(
            f"{name} ({source}) {why}, not through transformers' attention interface, so upipe's attention (register()) "
            "cannot reach it, and its own attention is refused under context parallelism. upipe cannot run "
            f"{family} with context parallelism: train it without backend='upipe', or pick a family that uses the "
            "interface (Llama, Mistral, Qwen, Gemma, ...)")

    return refuse


def _model_being_built() -> str | None:
    """The class of the outermost transformers model whose ``__init__`` is on the stack."""
    import inspect

    from transformers import PreTrainedModel

    names = [type(frame.f_locals["self"]).__name__ for frame, *_ in inspect.stack()
             if frame.f_code.co_name == "__init__" and isinstance(frame.f_locals.get("self"), PreTrainedModel)]
    return names[-1] if names else None


def packed_batch(input_ids: torch.Tensor, position_ids: torch.Tensor, cp_mesh=None, **per_token) -> dict:
    """Model kwargs for this rank from one packed, padding-free row over the FULL sequence:
    ``input_ids`` and ``position_ids`` ``[1, S]`` (positions restarting at 0 per document,
    as ``DataCollatorWithFlattening`` makes them), plus any other ``[1, S]`` tensors
    (e.g. ``labels=``). Returns this rank's shards of each and the documents' boundaries
    ``cu_seq_lens_q``/``cu_seq_lens_k`` over the full sequence, derived once here.
    Call the model with ``model(**packed_batch(...))``."""
    from upipe_compile.packed.cu_seqlens import cu_seqlens_from_position_ids
    from upipe_compile.sharding import shard_sequence

    if input_ids.shape[0] != 1 or position_ids.shape != input_ids.shape:
        raise ValueError(
            f"packed_batch takes one packed row: input_ids and position_ids [1, S], got {tuple(input_ids.shape)} "
            f"and {tuple(position_ids.shape)}"
        )
    cu_seqlens = cu_seqlens_from_position_ids(position_ids).to(input_ids.device)
    kwargs = {name: shard_sequence(t, cp_mesh, dim=1) for name, t in
              dict(input_ids=input_ids, position_ids=position_ids, **per_token).items()}
    kwargs.update(cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens)
    return kwargs

