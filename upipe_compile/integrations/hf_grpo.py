"""TRL's ``GRPOTrainer`` with UPipe context parallelism: the policy update over long rollouts
sharded over P ranks, generation and rewards left whole.

Every context-parallel rank of a group runs TRL's whole GRPO step on the same prompts, as the one
process of its data-parallel replica would:

- **generation** with transformers' ``generate`` on the whole model, uncompiled
  (``torch.compiler.set_stance("force_eager")``), with the model's own attention implementation
  and mixers; the ranks of a group sample alike (seeded by the replica, not the rank), so they
  hold the same completions, rewards and advantages;
- TRL's collectives (its ``gather``, ``gather_object`` and the accelerator's ``gather``,
  ``reduce``, ``num_processes``, ``process_index``) over the data-parallel replicas only
  (:class:`ReplicaAccelerator`, :func:`replica_view`), each group counted once;
- **scoring** (the policy's, the old policy's and the reference model's per-token
  log-probabilities, and entropies), :func:`sharded_log_probs`: each row right-aligned (its
  left padding moved to its end, every token keeping its position), cut into this rank's
  contiguous shard with labels shifted on the whole row, run through the upipe-compiled model
  and TRL's fused LM head, gathered back over the group. The gather's backward hands each rank
  its own slice of the (identical on every rank) gradient, times P: DDP's average over the P
  ranks is then the whole row's gradient. TRL's loss runs on the whole rows, on every rank.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

from upipe_compile.errors import UnsupportedAttention
from upipe_compile.integrations.hf_batch import IGNORE_INDEX
from upipe_compile.sharding import Layout

_MULTIMODAL = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
               "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


# --- TRL's collectives over the data-parallel replicas --------------------------------------------
def _gather(t: torch.Tensor, group) -> torch.Tensor:
    if group is None:
        return t
    t = t.contiguous() if t.dim() else t.reshape(1)
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t, group=group)
    return torch.cat(parts)


def _gather_object(obj: list, group) -> list:
    if group is None:
        return obj
    parts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, obj, group=group)
    return [item for part in parts for item in part]


class ReplicaAccelerator:
    """The trainer's accelerator as TRL's GRPO logic should see it under context parallelism: one
    process per data-parallel replica (a context-parallel group), its collectives over the
    replicas. Everything else is the real accelerator's."""

    def __init__(self, accelerator, group, replicas: int, replica: int):
        self._accelerator, self._group = accelerator, group
        self.num_processes, self.process_index = replicas, replica

    def __getattr__(self, name: str):
        return getattr(self._accelerator, name)

    def gather(self, tensor):
        return _gather(tensor, self._group)

    def gather_for_metrics(self, tensor, use_gather_object: bool = False):
        return _gather_object(tensor, self._group) if use_gather_object else _gather(tensor, self._group)

    def reduce(self, tensor, reduction: str = "sum", scale: float = 1.0):
        if self._group is not None:
            tensor = tensor.clone()
            dist.all_reduce(tensor, group=self._group)
            if reduction == "mean":
                tensor = tensor / dist.get_world_size(self._group)
        return tensor * scale if scale != 1.0 else tensor


@contextlib.contextmanager
def replica_view(trainer):
    """TRL's GRPO code inside sees :class:`ReplicaAccelerator` and gathers over the replicas."""
    import trl.trainer.grpo_trainer as grpo

    group = trainer._upipe_replica_group
    view = ReplicaAccelerator(trainer.accelerator, group, trainer._upipe_replica_count, trainer._upipe_replica_index)
    saved = trainer.accelerator, grpo.gather, grpo.gather_object
    trainer.accelerator = view
    grpo.gather = lambda tensor: _gather(tensor, group)
    grpo.gather_object = lambda obj: _gather_object(obj, group)
    try:
        yield
    finally:
        trainer.accelerator, grpo.gather, grpo.gather_object = saved


@contextlib.contextmanager
def whole_model(model, attn_implementation: str):
    """Generation on the whole sequence: compiled code runs eagerly, with the model's own attention
    implementation and the hybrid families' own mixers."""
    from upipe_compile.integrations.transformers_mixers import original_mixers

    configs = {id(c): c for c in (model.config, model.config.get_text_config())}.values()
    saved = [(c, c._attn_implementation) for c in configs]
    for config, _ in saved:
        config._attn_implementation = attn_implementation
    try:
        with torch.compiler.set_stance("force_eager"), original_mixers():
            yield
    finally:
        for config, implementation in saved:
            config._attn_implementation = implementation


# --- sharded scoring --------------------------------------------------------------------------------
class _GatherShards(torch.autograd.Function):
    """The whole ``[B, S]`` from every rank's contiguous ``[B, S/P]``. Backward: this rank's slice
    of the gradient, times P (every rank computes the same loss from the same whole tensor, so the
    slices are what a reduce-scatter would sum, and DDP averages the P ranks' gradients)."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, group):
        ctx.group, ctx.share = group, shard.shape[1]
        parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, shard.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        world, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.narrow(1, rank * ctx.share, ctx.share) * world, None


def right_aligned(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int, multiple: int):
    """Each row with its left padding moved to its end, then padded on the right to a multiple of
    ``multiple``: (ids, position ids, shifted labels, where each original column went). Real tokens
    keep their positions (the column they had: what the model gives a left-padded row) and see only
    earlier real tokens under causal attention; only the last ``logits_to_keep`` columns (the
    completion) carry labels, as TRL scores them. Also returned: which rotated columns are real
    tokens (the attention mask of the new layout)."""
    batch, length = input_ids.shape
    columns = torch.arange(length, device=input_ids.device)
    left = (attention_mask.cumsum(1) == 0).sum(1, keepdim=True)  # leading padding of each row
    source = (columns + left) % length  # rotated column j holds original column source[j]
    ids = input_ids.gather(1, source)
    real = attention_mask.gather(1, source).bool()
    labels = ids.masked_fill(~real | (source < length - logits_to_keep), IGNORE_INDEX)
    positions = columns + left  # the moved padding continues past the row's end
    extra = -length % multiple
    if extra:
        ids = F.pad(ids, (0, extra), value=0)
        labels = F.pad(labels, (0, extra), value=IGNORE_INDEX)
        real = F.pad(real, (0, extra), value=False)
        positions = torch.cat([positions, positions[:, -1:] + 1 + torch.arange(extra, device=ids.device)], dim=1)
    shift_labels = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    # the log-prob of original column i (>= 1) sits at rotated shift position i - left - 1
    completion = length - logits_to_keep + torch.arange(logits_to_keep, device=ids.device)
    return ids, positions, shift_labels, completion[None] - left - 1, real


def router_loss(model):
    """The MoE load-balancing loss as TRL's fused LM head computes it (transformers' Mixtral
    ``load_balancing_loss_func`` with the text config's expert counts), as a function of every
    layer's router logits and the attention mask; None where the model states no expert counts."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    config = model.config.get_text_config()
    experts = getattr(config, "num_experts", None) or getattr(model, "num_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    if experts is None or top_k is None:
        return None
    return lambda router_logits, mask: load_balancing_loss_func(tuple(router_logits), experts, top_k, mask)


def sharded_log_probs(trainer, model, input_ids, attention_mask, logits_to_keep: int, compute_entropy: bool,
                      compute_aux_loss: bool = False, batch_size: int | None = None):
    """TRL's per-token log-probabilities (and entropies) of the completion, ``[B, logits_to_keep]``,
    computed on this rank's shard of each row and gathered over the context-parallel group; with
    ``compute_aux_loss``, the MoE router's load-balancing loss of the whole rows (each layer's router
    logits gathered over the group, padding masked), averaged over chunks of ``batch_size`` rows as
    TRL does."""
    mesh, world = trainer._upipe_mesh, trainer._upipe_world
    group = mesh.get_group()
    layout = Layout.of(mesh)
    ids, positions, shift_labels, index, real = right_aligned(input_ids, attention_mask, logits_to_keep,
                                                              layout.multiple)
    share = ids.shape[1] // world
    log_probs, entropies, routers = [], [], []
    unwrapped = trainer.accelerator.unwrap_model(model)
    # TRL's fused head reads the backbone's router logits but returns only its loss over this shard
    captured: list = []
    hook = unwrapped.base_model.register_forward_hook(
        lambda module, args, out: captured.append(out.router_logits)) if compute_aux_loss else None
    try:
        for row in range(ids.shape[0]):  # one row a forward: the op reads a row's positions as one sequence
            cut = {"input_ids": ids[row:row + 1], "position_ids": positions[row:row + 1],
                   "shift_labels": shift_labels[row:row + 1]}
            # contiguous shards, marked so the backend's token-mixing check knows the sequence dimension
            cut = {key: layout.shard(value, dim=1).contiguous() for key, value in cut.items()}
            trainer._upipe_check_host(cut)  # offload: this shard's layer inputs against the node's memory
            with trainer.accelerator.autocast():
                outputs = model(**cut, fused_lm_head=True, use_cache=False,
                                **({"output_router_logits": True} if compute_aux_loss else {}))
            log_probs.append(_GatherShards.apply(outputs.log_probs, group))
            if compute_entropy:
                entropies.append(_GatherShards.apply(outputs.entropy, group))
            if compute_aux_loss:  # each layer's [tokens, experts] of the whole row
                routers.append([_GatherShards.apply(layer.reshape(1, share, -1), group)[0]
                                for layer in captured.pop()])
    finally:
        if hook is not None:
            hook.remove()
    log_probs = torch.cat(log_probs).gather(1, index)
    aux_loss = None
    if compute_aux_loss:
        loss = router_loss(unwrapped)
        step = batch_size or ids.shape[0]
        chunks = [loss([torch.cat(layer) for layer in zip(*routers[start:start + step])], real[start:start + step])
                  for start in range(0, ids.shape[0], step)]
        aux_loss = torch.stack(chunks).mean()
    return log_probs, torch.cat(entropies).gather(1, index) if compute_entropy else None, aux_loss


# --- the trainer ------------------------------------------------------------------------------------
def grpo_problems(trainer) -> list[str]:
    """What UPipeGRPOTrainer's sharded step cannot honour in TRL's arguments."""
    args, out = trainer.args, []
    if getattr(args, "use_vllm", False):
        out.append("use_vllm=True: generation through vLLM is not wired to upipe's context-parallel groups yet; "
                   "generate with transformers (use_vllm=False)")
    if getattr(args, "use_transformers_paged", False) or getattr(trainer, "use_transformers_continuous_batching",
                                                                 False):
        out.append("transformers' continuous batching for generation is not supported with upipe's context "
                   "parallelism: leave it off")
    if trainer._upipe_ring_degree != 1:
        out.append(f"ring_degree={trainer._upipe_ring_degree}: UPipeGRPOTrainer shards contiguously over one "
                   "all-to-all group; use ring_degree=1")
    if not trainer._upipe_own_layout:
        out.append("ParallelismConfig(cp_size=P): UPipeGRPOTrainer runs under DDP (pass cp_size= to the trainer, "
                   "no ParallelismConfig)")
    model = trainer.accelerator.unwrap_model(trainer.model)
    if getattr(trainer, "aux_loss_enabled", False) and router_loss(model) is None:
        out.append(f"router_aux_loss_coef={trainer.router_aux_loss_coef}: {type(model).__name__} computes its "
                   "router's auxiliary loss otherwise than transformers' load_balancing_loss_func(router_logits, "
                   "num_experts, num_experts_per_tok, attention_mask), which upipe gathers over the group; set "
                   "GRPOConfig(router_aux_loss_coef=0.0)")
    return out


def grpo_trainer_class(mixin):
    from accelerate.utils import set_seed
    from trl import GRPOTrainer

    class UPipeGRPOTrainer(mixin, GRPOTrainer):
        """TRL's ``GRPOTrainer`` with UPipe context parallelism (:mod:`upipe_compile.integrations.
        hf_grpo`). ``GRPOConfig.generation_batch_size`` is counted over the data-parallel replicas
        (the trainer's own copy of the config), so that a group of P ranks trains on what one
        process would."""

        def __init__(self, *args, **kwargs):
            if kwargs.get("loss_chunk_tokens"):
                raise UnsupportedAttention(
                    "loss_chunk_tokens: TRL's GRPOTrainer already scores through its fused LM head, in token "
                    "chunks, never the whole logits; leave loss_chunk_tokens=0")
            def count_over_replicas(cfg):
                size = self._upipe_plan_size(cfg)
                if size > 1 and cfg.world_size % size == 0:
                    replicas = cfg.world_size // size
                    cfg.generation_batch_size = cfg.per_device_train_batch_size * replicas * cfg.steps_per_generation

            args, kwargs = self._upipe_own_config(args, kwargs, count_over_replicas)
            super().__init__(*args, **kwargs)

        def _upipe_argument_problems(self) -> list[str]:
            return grpo_problems(self)

        def _upipe_setup(self) -> None:
            from upipe_compile.integrations.transformers import ATTN_IMPLEMENTATION

            model = self.accelerator.unwrap_model(self.model)
            # generation runs the model's own attention (a model loaded with "upipe": SDPA)
            own = model.config._attn_implementation
            self._upipe_generation_attention = "sdpa" if own in (None, ATTN_IMPLEMENTATION) else own
            super()._upipe_setup()
            world = self._upipe_world
            replicas = self._upipe_replicas
            self._upipe_replica_count = self.accelerator.num_processes // world
            self._upipe_replica_index = self.accelerator.process_index // world
            self._upipe_replica_group = None if replicas is None or replicas.size() == 1 else replicas.get_group()
            if world == 1:
                return
            if self.ref_model is not None:
                self._upipe_compile(self.accelerator.unwrap_model(self.ref_model))
            # TRL seeds each process apart so that they sample apart: a group's ranks sample alike
            set_seed(self.args.seed + self._upipe_replica_index)

        def _prepare_context_parallel_inputs(self, model, inputs):
            if self._upipe_world == 1:
                return super()._prepare_context_parallel_inputs(model, inputs)
            return contextlib.nullcontext, inputs  # the scoring shards each row itself

        def _generate_and_score_completions(self, inputs):
            if self._upipe_world == 1:
                return super()._generate_and_score_completions(inputs)
            with replica_view(self):
                return super()._generate_and_score_completions(inputs)

        def _generate_single_turn(self, *args, **kwargs):
            if self._upipe_world == 1:
                return super()._generate_single_turn(*args, **kwargs)
            model = self.accelerator.unwrap_model(self.model)
            with whole_model(model, self._upipe_generation_attention):
                return super()._generate_single_turn(*args, **kwargs)

        def _compute_loss(self, model, inputs):
            if self._upipe_world == 1:
                return super()._compute_loss(model, inputs)
            with replica_view(self):
                return super()._compute_loss(model, inputs)

        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                               batch_size=None, compute_entropy=False, compute_aux_loss=False,
                                               **multimodal):
            if self._upipe_world == 1:
                return super()._get_per_token_logps_and_entropies(
                    model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                    compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **multimodal)
            given = sorted(k for k, v in multimodal.items() if v is not None)
            if given:
                raise UnsupportedAttention(
                    f"UPipeGRPOTrainer scores text-only causal LMs: {given} cannot be sharded over the sequence yet")
            return sharded_log_probs(self, model, input_ids, attention_mask, logits_to_keep, compute_entropy,
                                     compute_aux_loss, batch_size)

    UPipeGRPOTrainer.__qualname__ = "UPipeGRPOTrainer"
    return UPipeGRPOTrainer
