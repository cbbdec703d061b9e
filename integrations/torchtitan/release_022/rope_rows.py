"""Each rank keeps only its own tokens' rows of the model's RoPE table.

torchtitan's Llama3 and Qwen3 hold one RoPE table for the whole sequence (``freqs_cis``
``[seq_len, head_dim / 2]`` complex64, ``rope_cache`` ``[seq_len, 2 x head_dim]``) on every
rank, and index it with the ``positions`` of the rank's tokens in every block. At long
context that replicated table is large (Llama3-8B at 24M tokens: 12 GiB per rank) while a
rank reads only ``seq_len / P`` rows of it. Under upipe the rows a rank needs are fixed by the
layout (:func:`upipe_compile.sharding.global_positions`), so before the model's forward the
table is cut down to exactly those rows, in the rank's token order, and the model is called
without ``positions``: it then reads rows ``0 .. seq_len / P - 1`` of the cut table, the same
values it would have gathered from the full one. The input sharding
(:mod:`upipe_compile.integrations.torchtitan.cp_layout`) gives no positions to match. A step
of another length (the validator's) cuts again from a freshly made whole table.
"""

from __future__ import annotations

import torch.nn as nn

from upipe_compile.errors import UnsupportedAttention
from upipe_compile.sharding import global_positions

ROPE_BUFFERS = ("freqs_cis", "rope_cache")
"""The RoPE table's buffer name in torchtitan's Llama3 and Qwen3."""


def rope_buffer_name(model: nn.Module) -> str | None:
    return next((name for name in ROPE_BUFFERS if getattr(model, name, None) is not None), None)


_PRECOMPUTE = {"freqs_cis": "_precompute_freqs_cis", "rope_cache": "_precompute_rope_cache"}
"""The model method that makes each table for the whole sequence (torchtitan 0.2.2)."""


def keep_local_rope_rows(model: nn.Module, layout_mesh) -> None:
    """Cut ``model``'s RoPE table to this rank's rows before a forward that finds a table it
    did not cut (the first one, and after ``init_weights`` rebuilds it), or a step of
    another length (the validator's); refuse ``positions``. Register it after any hook that
    casts the model's buffers, so the table it cut is the one the next forward finds."""
    name = rope_buffer_name(model)
    if name is None:
        raise UnsupportedAttention(f"{type(model).__name__} has none of the RoPE tables {ROPE_BUFFERS} that the "
                                   "upipe torchtitan integration knows")
    ranks = layout_mesh.size()

    def cut_table(module, args, kwargs):
        if kwargs.get("positions") is not None:
            raise UnsupportedAttention(
                "the model got RoPE positions, but under upipe each rank's RoPE table already holds its own tokens' "
                "rows (rope_rows.py): shard the batch with the Trainer's prepare_context_parallel_input, which "
                "the upipe import routes through cp_layout.py and which gives no positions")
        tokens = args[0] if args else kwargs["tokens"]
        local = tokens.shape[1]
        table = getattr(module, name)
        made, made_for = getattr(module, "upipe_rope_cut", (None, None))
        if table is made:
            if made_for == local:
                return None
            # cut for another length: start again from the whole sequence's table
            table = getattr(module, _PRECOMPUTE[name])().to(device=table.device, dtype=table.dtype)
        if table.shape[0] < local * ranks:
            raise UnsupportedAttention(
                f"the RoPE table has {table.shape[0]} rows, fewer than the {local * ranks} tokens of this step's "
                "sequence: raise the model's max_seq_len to the job's seq_len")
        cut = table.index_select(0, global_positions(local, layout_mesh, device=table.device)[0])
        setattr(module, name, cut)
        module.upipe_rope_cut = (cut, local)
        return None

    model.register_forward_pre_hook(cut_table, with_kwargs=True)
