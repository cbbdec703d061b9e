"""transformers families that pick their attention class from a table of their own.

Falcon and GPT-Neo do not call transformers' attention interface: each decoder layer looks up
``FALCON_ATTENTION_CLASSES[config._attn_implementation]`` (``GPT_NEO_ATTENTION_CLASSES``), so
``attn_implementation=register()`` would find no entry. :func:`route_own_attention_tables`
adds an ``"upipe"`` entry to each table: the family's own attention class with its attention
product routed where upipe rewrites it, everything else (projections, RoPE, merging heads) as
the family writes it.

- Falcon: the layer has an SDPA branch of its own, chosen by ``config._attn_implementation ==
  "sdpa"``. The upipe layer takes that branch (it reads a copy of the config that says so);
  the model's mask still comes from register()'s mask function (None without padding), so the
  branch calls SDPA with ``is_causal=True``, which the backend rewrites. Falcon with ALiBi
  (``config.alibi``) folds the bias into a materialised mask instead: refused by name.
- GPT-Neo: its eager product (no score scaling; a window of ``config.window_size`` keys on its
  "local" layers, the query included) goes to register()'s attention function with
  ``scaling=1.0`` and ``sliding_window=window_size`` on local layers.

:func:`route_own_attention_tables` also replaces the forwards of Llama 4's decoder layer and
attention, whose attention never sees ``position_ids`` (the layer keeps them): under context
parallelism the layer hands them on, the chunked layers' attention passes them to the
attention function (the chunks are fixed spans of the global positions), and the NoPE layers
scale their queries by the temperature of each token's global position (the model computes it
from ``torch.arange`` over its input plus the cache's length, which on a shard would be the
shard's own positions; restarting per packed document, as each document run alone has
them). Without context parallelism the model's own forwards run.

Bloom and MPT write their ALiBi attention in the layer: the layer forwards are replaced so that
on a model built with register()'s attention (:func:`mark_own_attention_layers` marks its
layers) the projections run as the family writes them and the product goes to register()'s
attention function with the family's slopes, which upipe runs as the ALiBi variant. Their
caches are refused (generation: load the model with eager attention).
"""

from __future__ import annotations

import copy
import importlib

import torch

from upipe_compile.errors import UnsupportedAttention
from upipe_compile.integrations.transformers_attention import ATTN_IMPLEMENTATION, _context_parallel, _upipe_attention_forward


def _falcon_attention(module):
    class UPipeFalconAttention(module.FalconAttention):
        """Falcon's attention, taking its own SDPA branch (see the module docstring)."""

        def __init__(self, config, layer_idx=None):
            if config.alibi:
                raise UnsupportedAttention(
                    "Falcon with ALiBi (config.alibi=True) adds the bias to a mask it materialises over the local "
                    "shard, which upipe cannot run with context parallelism: train a Falcon configuration with "
                    "rotary positions (alibi=False), or train without backend='upipe'")
            super().__init__(config, layer_idx)
            self.config = copy.copy(config)
            self.config._attn_implementation = "sdpa"

    return UPipeFalconAttention


def _gpt_neo_attention(module):
    class UPipeGPTNeoSelfAttention(module.GPTNeoSelfAttention):
        """GPT-Neo's attention with its product through register()'s attention function."""

        def _attn(self, query, key, value, attention_mask=None):
            window = self.config.window_size if self.attention_type == "local" else None
            dropout = self.attn_dropout.p if self.training else 0.0
            out, _ = _upipe_attention_forward(self, query, key, value, attention_mask, dropout=dropout, scaling=1.0,
                                              sliding_window=window)
            return out.transpose(1, 2), None  # [B, S, H, D] -> GPT-Neo's [B, H, S, D]

    return UPipeGPTNeoSelfAttention


_POSITIONS = "upipe_position_ids"
"""The keyword Llama 4's upipe decoder layer hands the positions to its attention under."""


def _llama4_layer_forward(original, module):
    def forward(self, hidden_states, attention_mask=None, position_ids=None, **kwargs):
        if position_ids is not None and _context_parallel():
            kwargs[_POSITIONS] = position_ids
        return original(self, hidden_states, attention_mask=attention_mask, position_ids=position_ids, **kwargs)

    return forward


def _llama4_attention_forward(original, module):
    def forward(self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
        position_ids = kwargs.pop(_POSITIONS, None)
        if position_ids is None:
            return original(self, hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs)
        kwargs["position_ids"] = position_ids  # the chunks of the chunked layers
        if self.use_rope or not self.attn_temperature_tuning:
            return original(self, hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs)
        # a NoPE layer (no RoPE, no QK-norm) as the model writes it, its temperature from the
        # tokens' positions (the cache is off under context parallelism)
        input_shape = hidden_states.shape[:-1]
        query = self.q_proj(hidden_states).view(*input_shape, -1, self.head_dim)
        key = self.k_proj(hidden_states).view(*input_shape, -1, self.head_dim).transpose(1, 2)
        value = self.v_proj(hidden_states).view(*input_shape, -1, self.head_dim).transpose(1, 2)
        scales = torch.log1p(torch.floor((position_ids.float() + 1.0) / self.floor_scale)) * self.attn_scale + 1.0
        query = (query * scales[..., None, None]).to(query.dtype).transpose(1, 2)
        attention = module.ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                                module.eager_attention_forward)
        out, weights = attention(self, query, key, value, attention_mask,
                                 dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling,
                                 **kwargs)
        return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights

    return forward


def _bloom_forward(original, module):
    def forward(self, hidden_states, residual, alibi, attention_mask, layer_past=None, use_cache=False,
                output_attentions=False, **kwargs):
        if not getattr(self, _MARK, False):
            return original(self, hidden_states, residual, alibi, attention_mask, layer_past=layer_past,
                            use_cache=use_cache, output_attentions=output_attentions, **kwargs)
        _refuse_a_past(self, layer_past)
        batch, length, _ = hidden_states.shape
        query, key, value = self._reshape(self.query_key_value(hidden_states))
        # Bloom adds slope * j (the key's position): for causal attention the same softmax as -slope * (i - j)
        slopes = module._get_alibi_slopes(self.num_heads, hidden_states.device)
        out, _ = _upipe_attention_forward(self, query, key, value, attention_mask, dropout=self.attention_dropout.p if self.training else 0.0,
                                         
                                          scaling=self.inv_norm_factor, alibi_slopes=slopes)
        out = self.dense(out.reshape(batch, length, self.hidden_size))
        return module.dropout_add(out, residual, self.hidden_dropout, self.training), None

    return forward


def _mpt_forward(original, module):
    def forward(self, hidden_states, position_bias, cache=None, attention_mask=None, **kwargs):
        if not getattr(self, _MARK, False):
            return original(self, hidden_states, position_bias, cache=cache, attention_mask=attention_mask, **kwargs)
        _refuse_a_past(self, cache)
        batch, length = hidden_states.shape[:2]
        qkv = self.Wqkv(hidden_states)
        if self.clip_qkv:
            qkv = qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
        query, key, value = (t.reshape(batch, length, self.n_heads, self.head_dim).transpose(1, 2)
                             for t in qkv.chunk(3, dim=2))
        # MPT adds slope * (j + 1 - L) (the key's position): for causal attention -slope * (i - j);
        # its own table's first column holds -slope
        slopes = -module.build_mpt_alibi_tensor(self.n_heads, 2, device=hidden_states.device)[:, 0, 0]
        dropout = self.attn_dropout_p if self.training else 0.0
        out, _ = _upipe_attention_forward(self, query, key, value, attention_mask, dropout=dropout,
                                          scaling=self.softmax_scale, alibi_slopes=slopes.float())
        return self.out_proj(out.reshape(batch, length, -1)), None

    return forward


_MARK = "_upipe_attention"
"""Set on the attention layers of a model built with register()'s attention (their forward,
replaced for every model of the family, runs the family's own code otherwise)."""


def _refuse_a_past(layer, past) -> None:
    if past is not None:
        raise UnsupportedAttention(
            f"{type(layer).__name__} with register()'s attention runs training and evaluation forwards, not "
            "generation from a cache: generate with the model loaded with attn_implementation='eager'")


def mark_own_attention_layers(model) -> None:
    """On a model built with register()'s attention: mark its layers whose forward upipe
    replaced for every model of the family (Bloom's, MPT's ALiBi attention)."""
    for family, forwards in OWN_LAYERS.items():
        layer_class = getattr(_family_module(family), next(iter(forwards)), None)
        if layer_class is None:
            continue
        for layer in model.modules():
            if isinstance(layer, layer_class):
                setattr(layer, _MARK, True)


# family -> (its attention table, the upipe class made from its module)
OWN_TABLES = {"falcon": ("FALCON_ATTENTION_CLASSES", _falcon_attention),
              "gpt_neo": ("GPT_NEO_ATTENTION_CLASSES", _gpt_neo_attention)}
# family -> (a layer class, its upipe forward made from the original and the module)
OWN_FORWARDS = {"llama4": {"Llama4TextDecoderLayer": _llama4_layer_forward,
                           "Llama4TextAttention": _llama4_attention_forward}}
# ALiBi families whose attention is written in their layer: the layer's forward, replaced, runs
# register()'s attention with the slopes on the layers mark_own_attention_layers marked
OWN_LAYERS = {"bloom": {"BloomAttention": _bloom_forward}, "mpt": {"MptAttention": _mpt_forward}}
_ROUTED = "_upipe_routed"


def route_own_attention_tables() -> list[str]:
    """Add the ``"upipe"`` entry to each family's attention table and replace the layer
    forwards above (idempotent); the families routed."""
    routed = []
    for family, (table_name, make) in OWN_TABLES.items():
        module = _family_module(family)
        table = getattr(module, table_name, None)
        if table is None:
            continue
        if ATTN_IMPLEMENTATION not in table:
            table[ATTN_IMPLEMENTATION] = make(module)
        routed.append(family)
    for family, forwards in {**OWN_FORWARDS, **OWN_LAYERS}.items():
        module = _family_module(family)
        layers = {name: getattr(module, name, None) for name in forwards}
        if None in layers.values():
            continue
        for name, layer in layers.items():
            if not getattr(layer.forward, _ROUTED, False):
                forward = forwards[name](layer.forward, module)
                setattr(forward, _ROUTED, True)
                forward.__wrapped_original__ = layer.forward
                layer.forward = forward
        routed.append(family)
    return routed


def _family_module(family: str):
    try:
        return importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    except ImportError:
        return None
