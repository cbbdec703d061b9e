"""Head-separable token mixers upipe runs over the whole sequence, and how their tensors are laid out.

A mixer here is a function whose every head (or channel) runs over the whole sequence on its
own: a depthwise causal conv (each channel), the gated delta rule (each value head). That is
UPipe's shape: a sequence->head all-to-all of its inputs, the mixer over the full sequence
for a chunk of heads, a head->sequence all-to-all of its output.

Each :class:`MixerSpec` names, for every tensor the mixer takes, where its sequence and head
dimensions are (activations) or its head dimension alone (per-head parameters, sliced to the
chunk); the output's layout; and how to call the model's own implementation on a chunk. The
implementations are the model's (transformers' torch fallbacks, or fla / causal-conv1d where
installed and chosen by transformers), registered under a name by
:func:`register_mixer` so that the ops can find them by a string.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Callable, Optional

import torch


@dataclass(frozen=True)
class TensorDims:
    """Where a tensor's sequence and head dimensions are; ``seq=None`` for a per-head parameter.

    ``grouped``: the head dimension holds groups, each shared by ``heads / groups`` consecutive
    heads (Mamba2's B and C, as KV heads under GQA). ``head=None``: one tensor shared by every
    head (Mamba's B and C); each stage sees it over the whole sequence."""

    head: Optional[int]
    seq: Optional[int] = None
    grouped: bool = False


@dataclass(frozen=True)
class MixerSpec:
    """One kind of head-separable mixer."""

    kind: str
    inputs: tuple[TensorDims, ...]
    output: TensorDims
    call: Callable[[Callable, list, dict], torch.Tensor]
    """``call(implementation, tensors, options)``: the mixer on (a head chunk of) its tensors."""
    output_like: Callable[[list], torch.Tensor]
    """An uninitialised output for these tensors (shape and dtype), without running the mixer."""

    @property
    def head_input(self) -> int:
        """The input whose head dimension counts the mixer's heads (not a group, not shared)."""
        return next(i for i, layout in enumerate(self.inputs) if layout.head is not None and not layout.grouped)


def _conv_call(fn, tensors, options):
    x, weight, bias = tensors
    return fn(x, weight, bias, activation=options.get("activation"))


def _delta_call(fn, tensors, options):
    q, k, v, g, beta = tensors
    out, _ = fn(q, k, v, g=g, beta=beta, chunk_size=options.get("chunk_size", 64), initial_state=None,
                output_final_state=False, use_qk_l2norm_in_kernel=options.get("use_qk_l2norm_in_kernel", False))
    return out


def _mamba2_call(fn, tensors, options):
    x, dt, a, b, c, d, dt_bias = tensors
    return fn(x, dt, a, b, c, chunk_size=options["chunk_size"], D=d, dt_bias=dt_bias,
              dt_softplus=options.get("dt_softplus", False), dt_limit=_limit(options.get("dt_limit")))


def _selective_call(fn, tensors, options):
    x, dt, a, b, c, d, z, delta_bias = tensors
    return fn(x, dt, a, b, c, D=d, z=z, delta_bias=delta_bias, delta_softplus=options.get("delta_softplus", False),
              use_mambapy=options.get("use_mambapy", False))


def _lightning_call(fn, tensors, options):
    q, k, v, slope = tensors
    return fn(q, k, v, slope, options["block_size"])


def _limit(text):
    """``dt_limit`` travels as text: ``"0.0,inf"`` (a float tuple with inf is no Python literal)."""
    return (0.0, float("inf")) if text is None else tuple(float(v) for v in text.split(","))


def _like_float_input(tensors):
    """The scans compute in float32 at least (transformers' torch scans return it)."""
    x = tensors[0]
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, torch.float32))


def _like_input(tensors):
    return tensors[0].new_empty(tensors[0].shape)


def _like_values(tensors):
    q, _, v = tensors[:3]
    return v.new_empty(v.shape, dtype=q.dtype)


KINDS = {
    # x [B, C, S], weight [C, K], bias [C]: one causal filter per channel
    "causal_conv1d": MixerSpec("causal_conv1d", (TensorDims(head=1, seq=2), TensorDims(head=0), TensorDims(head=0)),
                               TensorDims(head=1, seq=2), _conv_call, _like_input),
    # q, k [B, S, Hk, Dk] (Hk groups of value heads, as the kernels take them), v [B, S, H, Dv],
    # g, beta [B, S, H]
    "gated_delta_rule": MixerSpec("gated_delta_rule", (TensorDims(head=2, seq=1, grouped=True),) * 2
                                  + (TensorDims(head=2, seq=1),) * 3, TensorDims(head=2, seq=1), _delta_call,
                                  _like_values),
    # Mamba2's SSD scan: x [B, S, H, P], dt [B, S, H], A [H], B, C [B, S, G, N] (G groups of heads),
    # D [H], dt_bias [H]
    "mamba2_chunk_scan": MixerSpec("mamba2_chunk_scan",
                                   (TensorDims(head=2, seq=1), TensorDims(head=2, seq=1), TensorDims(head=0),
                                    TensorDims(head=2, seq=1, grouped=True), TensorDims(head=2, seq=1, grouped=True),
                                    TensorDims(head=0), TensorDims(head=0)),
                                   TensorDims(head=2, seq=1), _mamba2_call, _like_float_input),
    # Mamba's selective scan, one recurrence per channel: x, dt, z [B, C, S], A [C, N], B, C [B, N, S]
    # (shared by every channel), D, delta_bias [C]
    "selective_scan": MixerSpec("selective_scan",
                                (TensorDims(head=1, seq=2), TensorDims(head=1, seq=2), TensorDims(head=0),
                                 TensorDims(head=None, seq=2), TensorDims(head=None, seq=2), TensorDims(head=0),
                                 TensorDims(head=1, seq=2), TensorDims(head=0)),
                                TensorDims(head=1, seq=2), _selective_call, _like_float_input),
    # lightning attention (MiniMax): q, k, v [B, H, S, D], one decay rate per head [H, 1, 1]
    "lightning_attention": MixerSpec("lightning_attention", (TensorDims(head=1, seq=2),) * 3 + (TensorDims(head=0),),
                                     TensorDims(head=1, seq=2), _lightning_call, _like_values),
}

_IMPLEMENTATIONS: dict[str, tuple[str, Callable]] = {}


def register_mixer(name: str, kind: str, implementation: Callable) -> None:
    """Make ``implementation`` (a mixer of ``kind``) callable by the ops under ``name``."""
    _IMPLEMENTATIONS[name] = (kind, implementation)


def resolve(name: str) -> tuple[MixerSpec, Callable]:
    if name not in _IMPLEMENTATIONS:
        raise RuntimeError(f"upipe: no mixer registered as {name!r} in this process (register() registers them)")
    kind, implementation = _IMPLEMENTATIONS[name]
    return KINDS[kind], implementation


def encode(options: dict) -> str:
    """The mixer's scalar settings as the op's string argument; plain string building, which
    Dynamo traces without a graph break (json would break the graph in every layer)."""
    return ";".join(f"{key}={value!r}" for key, value in sorted(options.items()))


def decode(options: str) -> dict:
    if not options:
        return {}
    return {key: ast.literal_eval(value) for key, value in (item.split("=", 1) for item in options.split(";"))}

