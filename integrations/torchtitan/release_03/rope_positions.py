"""torchtitan 0.3: RoPE rows computed for the positions each forward uses, with no table.

0.3 gives every attention layer a RoPE module holding the whole table, ``max_seq_len`` rows
(``training.seq_len`` for a long-context job), and indexes it by each token's position. Every
rank holds it whole, once per layer: Llama3-8B at 24M tokens, 12 GiB per layer. A rank only
ever reads its own tokens' rows, and each row is a function of its position alone, so the
module computes those rows in each forward instead, exactly as the table would hold them:
the same frequencies (taken from the module's own table-building code, run over two
positions) and the same elementwise steps (the position as a float times each frequency,
then polar form, or cos and sin). Cost: one [tokens, head_dim] computation per layer per
forward, nothing next to attention.

Applied to 0.3's ComplexRoPE (Llama3) and CosSinRoPE (Qwen3); another RoPE keeps its table.
"""

from __future__ import annotations

import dataclasses
import types
from unittest import mock

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate
from torchtitan.models.common import rope as rope_module
from torchtitan.models.common.rope import ComplexRoPE, CosSinRoPE

FREQUENCIES = "upipe_frequencies"
"""The buffer (not persistent: checkpoints do not change) holding a module's frequencies."""


def frequencies(rope: nn.Module) -> torch.Tensor:
    """The frequency vector ``rope``'s table is built from: its own ``_precompute_cache`` run
    for two positions, the frequencies read where it multiplies positions by them."""
    captured = []
    proxy = types.ModuleType("torch")
    proxy.__dict__.update(torch.__dict__)

    def outer(positions, freqs):
        captured.append(freqs)
        return torch.outer(positions, freqs)

    proxy.outer = outer
    config = rope.config
    rope.config = dataclasses.replace(config, max_seq_len=2)
    try:
        with mock.patch.object(rope_module, "torch", proxy):
            type(rope)._precompute_cache(rope)
    finally:
        rope.config = config
    if len(captured) != 1:
        raise RuntimeError(f"{type(rope).__qualname__}'s table is not built as positions x frequencies")
    return captured[0]


def rows(rope: nn.Module, positions: torch.Tensor) -> torch.Tensor:
    """The table's rows for ``positions`` ([..., width]), as ``_precompute_cache`` computes them."""
    freqs = getattr(rope, FREQUENCIES)
    if isinstance(freqs, DTensor):  # (replicated by TP's parallelize until init_weights recomputes it)
        freqs = freqs.to_local()
    flat = positions.reshape(-1)
    if isinstance(rope, ComplexRoPE):  # integer positions times float frequencies, then polar
        angles = torch.outer(flat, freqs).float()
        table = torch.polar(torch.ones_like(angles), angles)
    else:  # CosSinRoPE: float positions; cos then sin of the angles twice over
        angles = torch.outer(flat.to(freqs.dtype), freqs).float()
        both = torch.cat([angles, angles], dim=-1)
        table = torch.cat([both.cos(), both.sin()], dim=-1)
    return table.view(*positions.shape, table.shape[-1])


def _reshape_cache(rope: nn.Module):
    def reshape_cache(query: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        if positions is None:  # as 0.3 does without positions: 0 .. seq_len - 1 for every row
            positions = torch.arange(query.shape[1], device=query.device).unsqueeze(0)
        if isinstance(positions, DTensor):
            positions = positions.to_local()
        table = rows(rope, positions)
        table = table.view(positions.shape[0], positions.shape[1], *([1] * (query.dim() - 3)), table.shape[-1])
        if isinstance(query, DTensor):  # under TP: the same rows on every TP rank (each holds all its tokens)
            table = DTensor.from_local(table, query.device_mesh, [Replicate()] * query.device_mesh.ndim,
                                       run_check=False)
        return table

    return reshape_cache


def _precompute_cache(rope: nn.Module):
    def precompute_cache() -> torch.Tensor:
        setattr(rope, FREQUENCIES, frequencies(rope))
        return torch.empty(0, 0)  # no table

    return precompute_cache


def compute_rope_rows(model: nn.Module) -> int:
    """Every ComplexRoPE / CosSinRoPE of ``model``'s attention layers computes its rows from
    the positions (call on the model built on meta, before init_weights). Returns how many."""
    done = 0
    for block in model.layers.values():
        rope = getattr(getattr(block, "attention", None), "rope", None)
        if type(rope) not in (ComplexRoPE, CosSinRoPE):
            continue
        rope.register_buffer(FREQUENCIES, torch.empty(0, device=rope.cache.device), persistent=False)
        sharding = getattr(rope, "_sharding_config", None)
        if sharding is not None and "cache" in sharding.state_shardings:  # TP distributes every buffer it names
            rope._sharding_config = dataclasses.replace(sharding, state_shardings={
                **sharding.state_shardings, FREQUENCIES: sharding.state_shardings["cache"]})
        rope.cache = torch.empty(0, 0, device=rope.cache.device)
        rope._precompute_cache = _precompute_cache(rope)
        rope._reshape_cache = _reshape_cache(rope)
        done += 1
    return done
