"""The batch layout of the Trainer path: one full-sequence batch, as Trainer's collators make it,
checked and cut into this rank's contiguous shard (labels shifted on the full sequence first,
positions kept, packed rows' document boundaries never sharded). Pure functions of the batch
and the rank; :class:`upipe_compile.integrations.hf_trainer.UPipeTrainerMixin` calls
:func:`upipe_batch` on every batch."""

from __future__ import annotations

from typing import Optional

import torch

from upipe_compile.errors import UnsupportedAttention

IGNORE_INDEX = -100


def _right_padded(mask: torch.Tensor) -> bool:
    """Each row is ones then zeros (and starts with a one)."""
    if mask.dim() != 2:
        return False
    m = mask.to(torch.int64)
    return bool((m[:, 0] == 1).all()) and bool((m[:, 1:] <= m[:, :-1]).all()) and bool(((m == 0) | (m == 1)).all())


def shift_labels_of(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """``shift_labels[t] = labels[t + 1]``, the last position ``ignore_index``: what a causal LM's
    loss does inside, done once on the full sequence so that the token at a shard's end keeps the
    label of the next shard's first token."""
    return torch.nn.functional.pad(labels[..., 1:], (0, 1), value=ignore_index)


def upipe_batch(inputs: dict, cp_mesh=None, *, world: Optional[int] = None) -> dict:
    """This rank's model kwargs from one full-sequence batch (the same on every
    context-parallel rank), as Trainer's collators make it: ``input_ids`` ``[B, S]`` and
    optionally ``labels``, ``attention_mask``, ``position_ids``, ``shift_labels``,
    ``cu_seq_lens_q/k`` and other per-token ``[B, S]`` tensors.

    Checks the batch (padding, divisibility), shifts the labels on the full sequence into
    ``shift_labels``, makes position ids when there are none, derives the documents'
    boundaries of a packed row from its position ids, and returns every per-token tensor's
    contiguous shard, the boundaries unsharded. Pure function of the batch and the rank."""
    from upipe_compile.attention.collectives import resolve_groups
    from upipe_compile.packed.cu_seqlens import cu_seqlens_from_position_ids
    from upipe_compile.sharding import Layout, sequence_multiple

    ring = cp_mesh is not None and getattr(cp_mesh, "ndim", 1) == 2  # ring x all-to-all: two zigzag chunks a ring rank
    if world is None:
        groups = resolve_groups(cp_mesh)
        world = groups[0].size() * (1 if groups[1] is None else groups[1].size())
    multiple = sequence_multiple(world, cp_mesh.size(0) if ring else 1)
    inputs = dict(inputs)
    if inputs.get("inputs_embeds") is not None:
        raise UnsupportedAttention(
            "upipe's trainer shards input_ids; a batch with inputs_embeds is not supported: pass input_ids")
    ids = inputs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise UnsupportedAttention(
            f"upipe's trainer needs input_ids [batch, sequence] in every batch, got "
            f"{None if ids is None else tuple(getattr(ids, 'shape', ()))}")
    batch, length = ids.shape

    mask = inputs.pop("attention_mask", None)
    labels = inputs.get("labels")
    if mask is not None and not bool(mask.all()):
        if not _right_padded(mask):
            raise UnsupportedAttention(
                "the batch has a padding mask that is not right padding (a zero before a one in a row: left "
                "padding, or padding between documents); under context parallelism a token would attend over "
                "padding that upipe cannot mask. Pad on the right (tokenizer.padding_side='right', the collators' "
                "default), or pack without padding: SFTConfig(padding_free=True), or DataCollatorWithFlattening")
        if labels is not None and bool((labels[mask == 0] != IGNORE_INDEX).any()):
            raise UnsupportedAttention(
                f"padded positions carry labels: set labels to {IGNORE_INDEX} where attention_mask is 0 (TRL's "
                "collators and DataCollatorForLanguageModeling do), so that padding never enters the loss")
        # Right padding needs no mask under causal attention: no real token attends to a later
        # padded one, and padded positions carry no label.
    if length % multiple:
        cut = f"the context-parallel size {world}" + (" x 2 (two zigzag chunks a ring rank)" if ring else "")
        raise UnsupportedAttention(
            f"sequence length {length} is not divisible by {cut}: pad every batch to a "
            f"multiple of {multiple}: SFTConfig(pad_to_multiple_of={multiple}), "
            f"DataCollatorForLanguageModeling(..., pad_to_multiple_of={multiple}) or "
            f"DataCollatorWithPadding(..., pad_to_multiple_of={multiple}) (padding goes on the right, labels "
            f"{IGNORE_INDEX})")

    if labels is not None and "shift_labels" not in inputs:
        inputs["shift_labels"] = shift_labels_of(labels)

    positions = inputs.get("position_ids")
    if positions is None:
        positions = torch.arange(length, device=ids.device).expand(batch, length)
        inputs["position_ids"] = positions
    elif positions.shape != ids.shape:
        raise UnsupportedAttention(
            f"position_ids {tuple(positions.shape)} do not match input_ids {tuple(ids.shape)}")
    if batch == 1:
        # One (possibly packed) row: the documents' boundaries over the full sequence, made
        # once per step from the full position ids (a collator's own are replaced by them).
        # Only cu_seq_lens_q: the attention reads k's as q's (self-attention), and a second
        # keyword for the same tensor loses its identity under activation checkpointing's
        # tracing (the attention could no longer tell that they agree).
        cu = cu_seqlens_from_position_ids(positions).to(ids.device)
        inputs.pop("cu_seq_lens_k", None)
        if cu.numel() > 2 or "cu_seq_lens_q" in inputs:
            inputs["cu_seq_lens_q"] = cu
    elif "cu_seq_lens_q" in inputs or "cu_seq_lens_k" in inputs:
        raise UnsupportedAttention(
            f"cu_seq_lens_q/k with {batch} rows: packed batches are one row (TRL's padding_free, "
            "DataCollatorWithFlattening)")

    out = {}
    layout = Layout.of(cp_mesh) if world > 1 else None
    for name, value in inputs.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == (batch, length) \
                and not name.startswith("cu_seq_lens"):
            # contiguous: the model's loss views its labels (shift_labels.view(-1))
            out[name] = layout.shard(value, dim=1).contiguous() if layout else value
        else:
            out[name] = value
    return out
