"""transformers' swappable mixer functions, routed through ``upipe::head_mixer``.

transformers calls a hybrid layer's mixers through module-level functions it can swap for a
hub kernel or a library (``causal_conv1d_fn``, ``torch_chunk_gated_delta_rule``: fla or
causal-conv1d where installed, else its torch fallback). :func:`route_mixers` wraps the
function each family's module holds, whichever implementation transformers chose, so that
under ``torch.compile`` the call becomes one ``upipe::head_mixer`` node: with one rank it
runs that same function; under ``backend="upipe"`` the pass rewrites it into the stage loop.
Eager calls go to the function directly (its own backward, no recompute). Calls
the loop cannot run exactly (a cache's state, ``seq_idx``, several packed rows, unknown
keywords) go to the function as they are, where the token-mixing check refuses them under
context parallelism. Packed documents' boundaries (``cu_seqlens``, or the attention's
``cu_seq_lens_q`` a layer hands on) go to the op: the mixer restarts at each document.
"""

from __future__ import annotations

import importlib

import torch

from upipe_compile.integrations.transformers_kwargs import IGNORED_KWARGS
from upipe_compile.mixers import ops  # noqa: F401  (registers the ops)
from upipe_compile.mixers.lightning import lightning_attention
from upipe_compile.mixers.registry import encode, register_mixer

# family module -> {function name: mixer kind}
FAMILIES = {
    "qwen3_next": {"causal_conv1d_fn": "causal_conv1d", "torch_chunk_gated_delta_rule": "gated_delta_rule"},
    "qwen3_5": {"causal_conv1d_fn": "causal_conv1d", "torch_chunk_gated_delta_rule": "gated_delta_rule"},
    "qwen3_5_moe": {"causal_conv1d_fn": "causal_conv1d", "torch_chunk_gated_delta_rule": "gated_delta_rule"},
    "olmo_hybrid": {"causal_conv1d_fn": "causal_conv1d", "torch_chunk_gated_delta_rule": "gated_delta_rule"},
    "lara_mini": {"causal_conv1d_fn": "causal_conv1d", "torch_chunk_gated_delta_rule": "gated_delta_rule"},
    "lfm2": {"causal_conv1d_fn": "causal_conv1d"},
    "lfm2_moe": {"causal_conv1d_fn": "causal_conv1d"},
    "lfm3": {"causal_conv1d_fn": "causal_conv1d"},
    "inkling": {"causal_conv1d_fn": "causal_conv1d"},
    "inkling2": {"causal_conv1d_fn": "causal_conv1d"},
    "inkling2_loop": {"causal_conv1d_fn": "causal_conv1d"},
}
# Mamba2 hybrids (Bamba, Falcon-H1, Granite-4 hybrid, Nemotron-H, Zamba2) and Mamba (Jamba,
# Zamba): the conv and the scan are routed; the fused kernel (conv + scan + norm + out_proj in
# one call, taken in training where mamba-ssm is installed) is declined under compile, so the
# layer takes its split path, whose pieces are routed
_MAMBA2 = {"causal_conv1d_fn": "causal_conv1d", "mamba2_chunk_scan": "mamba2_chunk_scan",
           "mamba2_split_conv1d_scan_combined": "fused"}
_MAMBA = {"causal_conv1d_fn": "causal_conv1d", "mamba_selective_scan": "selective_scan", "mamba_inner_fn": "fused"}
FAMILIES.update({family: _MAMBA2 for family in ("bamba", "falcon_h1", "granitemoehybrid", "nemotron_h", "zamba2",
                                                  "mamba2")})
FAMILIES.update({family: _MAMBA for family in ("jamba", "zamba", "mamba", "falcon_mamba")})
# transformers hands these families' selective scan no document boundaries, so packed documents
# share its state (its kernel and its torch scan alike); their conv does not restart either, so
# that upipe gives what transformers gives
_NO_DOCUMENT_RESTART = {"jamba", "zamba", "mamba", "falcon_mamba"}

_ROUTED = "_upipe_routed"


# family module -> layer classes whose mixer is written inline in forward (no function to
# swap): their forward is replaced by one that calls the mixer through the op
LAYERS = {"minimax": {"MiniMaxLightningAttention": "lightning_attention"}}


def route_mixers() -> list[str]:
    """Wrap every known family's mixer functions and layers (idempotent); the names routed."""
    routed = []
    for name, owner, attribute, kind, module in _targets():
        original = getattr(owner, attribute)
        if not getattr(original, _ROUTED, False):
            if owner is module:  # a module-level function: the family's own implementation runs
                if kind != "fused":
                    register_mixer(name, kind, original)
                wrapper = _WRAPPERS[kind](name, original)
            else:  # a layer's forward: upipe's implementation of its inline mixer runs
                register_mixer(name, kind, _LAYER_MIXERS[kind])
                wrapper = _LAYER_FORWARDS[kind](name, original, module)
            setattr(wrapper, _ROUTED, True)
            wrapper.__wrapped_original__ = original
            setattr(owner, attribute, wrapper)
        routed.append(name)
    return routed


def _targets():
    """``(name, owner, attribute, kind, family module)`` of each function (owner: the family's
    module) and layer forward (owner: the layer class) that transformers has."""
    for table in (FAMILIES, LAYERS):
        for family, entries in table.items():
            module = _family_module(family)
            if module is None:
                continue
            for entry, kind in entries.items():
                found = getattr(module, entry, None)
                if found is None:
                    continue
                if table is FAMILIES:
                    yield f"{family}.{entry}", module, entry, kind, module
                else:
                    yield f"{family}.{entry}", found, "forward", kind, module


def _family_module(family: str):
    try:
        return importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    except ImportError:
        return None


# flags a layer hands on with its kwargs that change nothing in a mixer (the documents'
# seq_idx and lengths do: they go to the function as it is)
_HARMLESS = IGNORED_KWARGS - {"seq_idx", "max_length_q", "max_length_k"}


def _set(kwargs: dict) -> bool:
    return any(v is not None for k, v in kwargs.items() if k not in _HARMLESS)


def _conv(name, original):
    restarts = name.split(".")[0] not in _NO_DOCUMENT_RESTART

    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        # packed documents come as the attention's boundaries (the layer hands its kwargs on)
        documents = kwargs.get("cu_seq_lens_q") if restarts else None
        rest = {k: v for k, v in kwargs.items() if k not in ("cu_seq_lens_q", "cu_seq_lens_k")}
        if not torch.compiler.is_compiling() or _set(rest) or (documents is not None and hidden_states.shape[0] != 1):
            return original(hidden_states, weight, bias, activation=activation, **kwargs)
        options = {"activation": activation, "absent": [2] if bias is None else []}
        return torch.ops.upipe.head_mixer(name, [t for t in (hidden_states, weight, bias) if t is not None],
                                          encode(options), documents)

    return causal_conv1d_fn


def _delta(name, original):
    def chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=64, initial_state=None,
                               output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
        rest = {k: v for k, v in kwargs.items() if k != "cu_seq_lens_k"}  # the same boundaries as cu_seqlens
        if (not torch.compiler.is_compiling() or initial_state is not None or output_final_state or _set(rest)
                or (cu_seqlens is not None and value.shape[0] != 1)):
            return original(query, key, value, g=g, beta=beta, chunk_size=chunk_size, initial_state=initial_state,
                            output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                            cu_seqlens=cu_seqlens, **kwargs)
        # q/k keep their own heads (each shared by a group of value heads): a stage gets the groups its heads share
        options = encode({"chunk_size": chunk_size, "use_qk_l2norm_in_kernel": use_qk_l2norm_in_kernel})
        return torch.ops.upipe.head_mixer(name, [query, key, value, g, beta], options, cu_seqlens), None

    return chunk_gated_delta_rule


def _mamba2(name, original):
    def mamba2_chunk_scan(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None,
                          dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, z=None,
                          **kwargs):
        documents = kwargs.get("cu_seq_lens_q")
        rest = {k: v for k, v in kwargs.items() if k not in ("cu_seq_lens_q", "cu_seq_lens_k")}
        if (not torch.compiler.is_compiling() or initial_states is not None or return_final_states or z is not None
                or _set(rest) or (documents is not None and hidden_states.shape[0] != 1)):
            return original(hidden_states, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias,
                            initial_states=initial_states, dt_softplus=dt_softplus, dt_limit=dt_limit,
                            return_final_states=return_final_states, z=z, **kwargs)
        given = (hidden_states, dt, A, B, C, D, dt_bias)
        options = {"chunk_size": chunk_size, "dt_softplus": dt_softplus,
                   "dt_limit": f"{float(dt_limit[0])},{float(dt_limit[1])}",
                   "absent": [i for i, t in enumerate(given) if t is None]}
        return torch.ops.upipe.head_mixer(name, [t for t in given if t is not None], encode(options), documents)

    return mamba2_chunk_scan


def _selective(name, original):
    def selective_scan(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                       return_last_state=False, use_mambapy=False, use_associative_scan=False, **kwargs):
        documents = kwargs.get("cu_seq_lens_q")
        rest = {k: v for k, v in kwargs.items() if k not in ("cu_seq_lens_q", "cu_seq_lens_k")}
        if (not torch.compiler.is_compiling() or return_last_state or _set(rest)
                or (documents is not None and hidden_states.shape[0] != 1)):
            return original(hidden_states, dt, A, B, C, D=D, z=z, delta_bias=delta_bias,
                            delta_softplus=delta_softplus, return_last_state=return_last_state,
                            use_mambapy=use_mambapy, use_associative_scan=use_associative_scan, **kwargs)
        given = (hidden_states, dt, A, B, C, D, z, delta_bias)
        options = {"delta_softplus": delta_softplus, "use_mambapy": use_mambapy,
                   "absent": [i for i, t in enumerate(given) if t is None]}
        return torch.ops.upipe.head_mixer(name, [t for t in given if t is not None], encode(options), documents)

    return selective_scan


def _fused(name, original):
    def fused_mixer(*args, **kwargs):
        # None makes the layer take its split path, whose conv and scan are routed
        return None if torch.compiler.is_compiling() else original(*args, **kwargs)

    return fused_mixer


_WRAPPERS = {"causal_conv1d": _conv, "gated_delta_rule": _delta, "mamba2_chunk_scan": _mamba2,
             "selective_scan": _selective, "fused": _fused}


def _lightning_layer(name, original, module):
    """MiniMax's lightning attention layer: its projections and output as the model writes
    them, the recurrence through the op (the model's own loop where the op cannot take it)."""

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        # the layer reads no positions and no document boundaries (packed documents share its
        # state in transformers, and so here); the decoder layer hands them to both attentions
        rest = {k: v for k, v in kwargs.items() if k not in ("cu_seq_lens_q", "cu_seq_lens_k", "position_ids")}
        if not torch.compiler.is_compiling() or cache is not None or _set(rest):
            return original(self, hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs)
        batch, length, _ = hidden_states.shape
        qkv = module.apply_mask_to_padding_states(self.act_fn(self.qkv_proj(hidden_states)), attention_mask)
        qkv = qkv.reshape(batch, length, self.num_attention_heads, 3 * self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in torch.split(qkv, self.head_dim, dim=3))
        out = torch.ops.upipe.head_mixer(name, [q, k, v, self.slope_rate], encode({"block_size": self.block_size}))
        out = self.norm(out.transpose(1, 2).reshape(batch, length, self.num_attention_heads * self.head_dim))
        return self.out_proj(torch.sigmoid(self.output_gate(hidden_states)) * out), None

    return forward


_LAYER_MIXERS = {"lightning_attention": lightning_attention}
_LAYER_FORWARDS = {"lightning_attention": _lightning_layer}


class original_mixers:
    """``with original_mixers():`` the families' own functions and layers, unrouted (a reference run)."""

    def __enter__(self):
        self.swapped = []
        for _, owner, attribute, _, _ in _targets():
            wrapper = getattr(owner, attribute)
            if getattr(wrapper, _ROUTED, False):
                self.swapped.append((owner, attribute, wrapper))
                setattr(owner, attribute, wrapper.__wrapped_original__)
        return self

    def __exit__(self, *exc):
        for owner, attribute, wrapper in self.swapped:
            setattr(owner, attribute, wrapper)
