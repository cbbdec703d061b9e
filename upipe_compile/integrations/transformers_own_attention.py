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
"""

from __future__ import annotations

import copy
import importlib

from upipe_compile.errors import UnsupportedAttention
from upipe_compile.integrations.transformers import ATTN_IMPLEMENTATION, _upipe_attention_forward


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


# family -> (its attention table, the upipe class made from its module)
OWN_TABLES = {"falcon": ("FALCON_ATTENTION_CLASSES", _falcon_attention),
              "gpt_neo": ("GPT_NEO_ATTENTION_CLASSES", _gpt_neo_attention)}


def route_own_attention_tables() -> list[str]:
    """Add the ``"upipe"`` entry to each family's attention table (idempotent); the families
    routed."""
    routed = []
    for family, (table_name, make) in OWN_TABLES.items():
        try:
            module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        except ImportError:
            continue
        table = getattr(module, table_name, None)
        if table is None:
            continue
        if ATTN_IMPLEMENTATION not in table:
            table[ATTN_IMPLEMENTATION] = make(module)
        routed.append(family)
    return routed
