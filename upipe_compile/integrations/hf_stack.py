"""The long-context stack on a transformers causal LM as ``UPipeTrainer`` builds it: chunked
output projection + loss, sequence-tiled gated MLP, offload of checkpointed decoder-layer
inputs. Each piece is a plain module of :mod:`upipe_compile.stack`; this file only checks
that the model's shape allows it exactly, swaps modules in place (same parameters under the
same names, so optimizer, DDP/FSDP and checkpoints see nothing new) and installs the hooks.

- ``loss_chunk_tokens``: ``lm_head`` becomes :class:`ChunkedLossHead` (in training it hands
  the hidden states and its weight to the loss instead of multiplying) and the model's
  ``loss_function`` becomes :func:`chunked_causal_lm_loss`, which runs
  :func:`upipe_compile.stack.chunked_loss.linear_cross_entropy` on them with the labels and
  ``num_items_in_batch`` transformers' own ``ForCausalLMLoss`` would get (so the Trainer's
  token weighting over the step is unchanged). Only models whose ``ForCausalLM.forward`` is
  Llama's or Mixtral's (MoE: the router's loss added after) statement for statement
  (``lm_head`` straight into ``loss_function``, nothing done to the logits between) and whose head has no bias and no logit scaling or soft-capping.
- ``mlp_tile_tokens``: each ``model.model.layers[i].mlp`` that is a SiLU-gated MLP of a known
  class becomes :class:`TiledGatedMLP` (:func:`upipe_compile.stack.tiled_mlp.swiglu`).
- ``offload_block_inputs``: :class:`upipe_compile.stack.offload.BlockInputOffloader` on the
  decoder layers, which needs gradient checkpointing (non-reentrant) and the layers compiled
  one by one (:func:`compile_layers`): its hooks must sit outside the compiled code so that they
  see what each compiled, checkpointed layer saves for backward.
"""

from __future__ import annotations

import ast
import functools
import inspect
import logging
import textwrap
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from upipe_compile.errors import UnsupportedAttention
from upipe_compile.stack.chunked_loss import IGNORE_INDEX, LazyLogits, LazyOutputProjection, linear_cross_entropy
from upipe_compile.stack.tiled_mlp import swiglu

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StackSettings:
    """The trainer's stack keywords, named as torchtitan's ``[upipe]`` keys; 0 / False = off.
    ``host_memory_reserve_gib`` None: the default reserve, scaled to the node
    (:func:`upipe_compile.stack.host_memory.default_host_reserve_gib`)."""

    loss_chunk_tokens: int = 0
    mlp_tile_tokens: int = 0
    offload_block_inputs: bool = False
    host_memory_reserve_gib: Optional[float] = None

    def problems(self) -> list[str]:
        out = []
        for key in ("loss_chunk_tokens", "mlp_tile_tokens"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                out.append(f"{key}={value!r} must be a whole number of tokens > 0 (or 0 = off)")
        if not isinstance(self.offload_block_inputs, bool):
            out.append(f"offload_block_inputs={self.offload_block_inputs!r} must be True or False")
        reserve = self.host_memory_reserve_gib
        bad_reserve = isinstance(reserve, bool) or not isinstance(reserve, (int, float)) or reserve < 0
        if reserve is not None and bad_reserve:
            out.append(f"host_memory_reserve_gib={reserve!r} must be a number >= 0 (or None: the default)")
        return out

    @property
    def on(self) -> bool:
        return bool(self.loss_chunk_tokens or self.mlp_tile_tokens or self.offload_block_inputs)


# --- chunked loss ------------------------------------------------------------------------------
class ChunkedLossHead(LazyOutputProjection):
    """``lm_head`` for the chunked loss: adopts the Linear's weight (tied or not, the same
    parameter). In training with gradients it returns :class:`LazyLogits` for the loss; otherwise
    (evaluate, predict, generate) the ordinary logits."""

    def forward(self, hidden: torch.Tensor):
        if self.training and torch.is_grad_enabled():
            return super().forward(hidden)
        return F.linear(hidden, self.weight)


def chunked_causal_lm_loss(logits, labels, vocab_size: int, num_items_in_batch=None, ignore_index: int = IGNORE_INDEX,
                           shift_labels=None, *, chunk_tokens: int, fallback, **kwargs) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` over :class:`LazyLogits`: the same shift, the same sum over
    ``num_items_in_batch`` (or mean over labelled tokens without it), the projection done in
    chunks. Real logits (evaluation) go to ``fallback``, the model's own loss."""
    if not isinstance(logits, LazyLogits):
        return fallback(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch, ignore_index=ignore_index,
                        shift_labels=shift_labels, **kwargs)
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    shift_labels = shift_labels.to(logits.hidden.device)
    loss = linear_cross_entropy(logits.hidden, logits.weight, shift_labels, chunk_tokens, ignore_index)
    if num_items_in_batch is None:
        return loss / (shift_labels != ignore_index).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def _body(function) -> str:
    """A function's statements without its docstring, as an AST dump (comments and the
    docstring's examples do not count; any change to what it computes does)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function))).body[0]
    body = tree.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return ast.dump(ast.Module(body=body, type_ignores=[]))


@functools.lru_cache(maxsize=None)
def _known_forward_bodies() -> tuple[str, ...]:
    """LlamaForCausalLM's forward (``lm_head`` straight into ``loss_function``) and
    MixtralForCausalLM's (the same, then the router's auxiliary loss, which reads the router
    logits, never the output logits, added to the loss): the forms most families share."""
    from transformers import LlamaForCausalLM, MixtralForCausalLM

    return _body(LlamaForCausalLM.forward), _body(MixtralForCausalLM.forward)


def _forward_is_known(cls) -> bool:
    try:
        return _body(cls.forward) in _known_forward_bodies()
    except (OSError, TypeError, SyntaxError):
        return False


def loss_problems(model: nn.Module, chunk: int) -> list[str]:
    """What the chunked loss cannot reproduce exactly on ``model``."""
    key, fix = f"loss_chunk_tokens={chunk}", "leave loss_chunk_tokens=0 (the model's own loss)"
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    name = type(model).__name__
    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward:
        return [f"{key} needs {name}.lm_head to be an nn.Linear, got {type(head).__name__}: {fix}"]
    if head.bias is not None:
        return [f"{key}: {name}.lm_head has a bias, which the chunked loss does not add: {fix}"]
    if getattr(text, "final_logit_softcapping", None):
        return [f"{key}: {name} soft-caps its logits (final_logit_softcapping={text.final_logit_softcapping}), "
                f"which the chunked loss does not apply: {fix}"]
    for scale in ("logit_scale", "logits_scaling", "output_multiplier", "lm_head_multiplier"):
        if getattr(text, scale, None) not in (None, 1, 1.0) or scale in vars(model):
            return [f"{key}: {name} scales its logits ({scale}), which the chunked loss does not apply: {fix}"]
    if not _forward_is_known(type(model)):
        return [f"{key}: {name}.forward is neither LlamaForCausalLM's nor MixtralForCausalLM's (lm_head straight "
                f"into loss_function), so it may do something to the logits the chunked loss would not: {fix}"]
    return []


def chunk_the_loss(model: nn.Module, chunk: int) -> None:
    model.lm_head = ChunkedLossHead(model.lm_head)
    model.loss_function = functools.partial(chunked_causal_lm_loss, chunk_tokens=chunk, fallback=model.loss_function)
    log.info("upipe: %s's output projection and loss in chunks of %d tokens", type(model).__name__, chunk)


# --- tiled MLP ---------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _gated_mlp_forwards() -> tuple:
    """``forward``s that are exactly ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` (read)."""
    from transformers.models.llama.modeling_llama import LlamaMLP
    from transformers.models.mistral.modeling_mistral import MistralMLP
    from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP
    from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP

    return tuple(cls.forward for cls in (LlamaMLP, MistralMLP, Qwen2MLP, Qwen3MLP))


def _is_silu(act) -> bool:
    from transformers.activations import SiLUActivation

    return type(act) in (nn.SiLU, SiLUActivation) and not getattr(act, "inplace", False)


def mlp_problem(mlp: nn.Module) -> Optional[str]:
    """Why ``mlp`` cannot run as a tiled SwiGLU, or None."""
    name = type(mlp).__name__
    if hasattr(mlp, "experts") or "moe" in name.lower() or "sparse" in name.lower():
        return f"{name} is a mixture-of-experts block: tiling its experts is not supported"
    if type(mlp).forward not in _gated_mlp_forwards():
        return (f"{name} is not a SiLU-gated MLP of a known class (LlamaMLP, MistralMLP, Qwen2MLP, Qwen3MLP: "
                "down_proj(silu(gate_proj(x)) * up_proj(x)))")
    if not _is_silu(getattr(mlp, "act_fn", None)):
        return f"{name}.act_fn is {type(getattr(mlp, 'act_fn', None)).__name__}, not SiLU"
    for attr in ("gate_proj", "up_proj", "down_proj"):
        linear = getattr(mlp, attr, None)
        plain = isinstance(linear, nn.Linear) and type(linear).forward is nn.Linear.forward
        if not plain or linear.bias is not None:
            return f"{name}.{attr} is not a bias-free nn.Linear (mlp_bias=True?)"
    return None


class TiledGatedMLP(nn.Module):
    """A SiLU-gated MLP over tiles of ``tile_tokens`` tokens; adopts ``gate_proj``, ``up_proj`` and
    ``down_proj`` under the same names (same parameters, same state-dict keys)."""

    def __init__(self, mlp: nn.Module, tile_tokens: int):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.tile_tokens = tile_tokens
        self.replaces = type(mlp).__name__

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x, self.gate_proj.weight, self.down_proj.weight, self.up_proj.weight, self.tile_tokens)

    def extra_repr(self) -> str:
        return f"tile_tokens={self.tile_tokens}, replaces={self.replaces}"


# --- layers, offload -------------------------------------------------------------------------------
def decoder_layers(model: nn.Module):
    """``model.model.layers`` (the base model's), or None."""
    layers = getattr(getattr(model, "base_model", model), "layers", None)
    return layers if isinstance(layers, nn.ModuleList) and len(layers) else None


def checkpointing_of(args) -> tuple[bool, dict]:
    """(gradient checkpointing on, its kwargs): transformers 5.x names them activation_checkpointing."""
    prefix = "activation" if hasattr(args, "activation_checkpointing_kwargs") else "gradient"
    return bool(getattr(args, f"{prefix}_checkpointing")), dict(getattr(args, f"{prefix}_checkpointing_kwargs") or {})


def stack_problems(model: nn.Module, settings: StackSettings, args) -> list[str]:
    """Everything the settings get wrong or the model's shape does not allow, before any change."""
    problems = settings.problems()
    if problems:
        return problems
    layers = decoder_layers(model)
    if (settings.mlp_tile_tokens or settings.offload_block_inputs) and layers is None:
        return [f"{type(model).__name__} has no decoder-layer list (model.model.layers) for mlp_tile_tokens / "
                "offload_block_inputs"]
    if settings.loss_chunk_tokens:
        problems += loss_problems(model, settings.loss_chunk_tokens)
    if settings.mlp_tile_tokens:
        for i, layer in enumerate(layers):
            problem = mlp_problem(getattr(layer, "mlp", None)) if hasattr(layer, "mlp") else \
                f"{type(layer).__name__} has no mlp"
            if problem:
                problems.append(f"mlp_tile_tokens={settings.mlp_tile_tokens} cannot tile layers[{i}].mlp: {problem}: "
                                "leave mlp_tile_tokens=0")
                break
    if settings.offload_block_inputs:
        on, kwargs = checkpointing_of(args)
        if not on:
            problems.append("offload_block_inputs=True needs TrainingArguments(gradient_checkpointing=True): "
                            "without checkpointing a layer saves much more than its input")
        elif kwargs.get("use_reentrant", False):
            problems.append("offload_block_inputs=True needs non-reentrant checkpointing: set "
                            "gradient_checkpointing_kwargs={'use_reentrant': False} (the default)")
    return problems


def apply_stack(model: nn.Module, settings: StackSettings, args) -> Optional["BlockInputOffloader"]:  # noqa: F821
    """Checks, then swaps modules and installs the offloader (returned, or None)."""
    problems = stack_problems(model, settings, args)
    if problems:
        raise UnsupportedAttention("; ".join(problems))
    if settings.loss_chunk_tokens:
        chunk_the_loss(model, settings.loss_chunk_tokens)
    layers = decoder_layers(model)
    if settings.mlp_tile_tokens:
        for layer in layers:
            layer.mlp = TiledGatedMLP(layer.mlp, settings.mlp_tile_tokens)
        log.info("upipe: the MLP of %d layers over tiles of %d tokens", len(layers), settings.mlp_tile_tokens)
    if not settings.offload_block_inputs:
        return None
    from upipe_compile.stack.offload import BlockInputOffloader

    offloader = BlockInputOffloader(list(layers))
    model.upipe_offloader = offloader  # for inspection; not a submodule
    return offloader


def compile_layers(model: nn.Module, **compile_kwargs) -> None:
    """Each decoder layer's ``forward`` compiled on its own (the checkpointed forward that
    transformers installs, so the recompute is inside the compiled code) while the layer's module
    hooks, the offloader's among them, stay outside it."""
    for layer in decoder_layers(model):
        if "forward" not in vars(layer):
            layer.forward = torch.compile(layer.forward, **compile_kwargs)


def check_host_memory(model: nn.Module, settings: StackSettings, tokens_per_rank: int, ranks: int) -> None:
    """Refuse a batch whose offloaded layer inputs (exactly what the offloader allocates on host)
    do not fit this node's memory next to the reserve."""
    from upipe_compile.stack.host_memory import node_host_memory_problem, ranks_per_node
    from upipe_compile.stack.offload import host_bytes_per_rank

    if not settings.offload_block_inputs:
        return
    layers = decoder_layers(model)
    dtype = model.get_input_embeddings().weight.dtype  # the residual stream's dtype
    per_rank = host_bytes_per_rank(len(layers), tokens_per_rank, model.config.get_text_config().hidden_size, dtype)
    problem = node_host_memory_problem(per_rank, ranks_per_node(default=ranks), settings.host_memory_reserve_gib)
    if problem:
        raise UnsupportedAttention(f"offload_block_inputs=True: {problem}. Use shorter sequences or a smaller batch, "
                                   "more context-parallel ranks (more nodes), or a lower host_memory_reserve_gib")
