"""The keywords transformers' models hand an attention or mixer function that change nothing
under upipe (one table, read by :mod:`upipe_compile.integrations.transformers` and
:mod:`upipe_compile.integrations.transformers_mixers`; any other keyword is refused)."""

IGNORED_KWARGS = frozenset({"use_cache", "output_attentions", "output_router_logits", "cache_position",
                            "max_length_q", "max_length_k", "num_items_in_batch", "shift_labels", "seq_idx"})
"""Cache and output flags, the longest document (upipe derives it from the boundaries), the
loss's keywords that a causal LM's forward hands its backbone along with the rest (Trainer's
``num_items_in_batch``, context parallelism's ``shift_labels``) and TRL's per-token document
index ``seq_idx`` (for linear attention's convolutions; softmax attention reads cu_seq_lens)."""
