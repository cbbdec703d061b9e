"""Hugging Face ``Trainer`` and TRL's ``SFTTrainer`` with UPipe context parallelism (and TRL's
``GRPOTrainer``: ``UPipeGRPOTrainer``, :mod:`upipe_compile.integrations.hf_grpo`).

Two or three added lines turn a working training script into a context-parallel one::

    from upipe_compile.integrations.hf_trainer import UPipeSFTTrainer   # or UPipeTrainer
    trainer = UPipeSFTTrainer(model=model, args=SFTConfig(..., padding_free=True), train_dataset=ds,
                              upipe_options={"heads_per_stage": 8})
    trainer.train()

What the mixin (:class:`UPipeTrainerMixin`, placed before the trainer class) does:

- attention: registers ``attn_implementation="upipe"`` (:func:`upipe_compile.integrations.
  transformers.register`) and switches the model to it, then compiles the model's backbone
  (``model.base_model``) in place with ``backend="upipe"`` over the context-parallel group.
  The LM head and the loss stay eager (transformers' loss, or TRL's fused LM head).
- data: every context-parallel rank gets the SAME batch, cut into this rank's shard by
  :func:`upipe_compile.integrations.hf_batch.upipe_batch` (checked on the full sequence, labels
  shifted there, contiguous shards, positions kept, document boundaries never sharded).
- loss: each rank's loss is the sum of its tokens' losses over the number of labelled tokens
  in the whole optimizer step (all micro-batches of gradient accumulation, all data-parallel
  replicas, each counted once although P ranks see it), passed as Trainer's
  ``num_items_in_batch`` (counted by the mixin: transformers releases count it differently
  under context parallelism). Trainer multiplies it by the number of processes and DDP/FSDP
  average gradients over them, so the gradient is the token-weighted mean over the global
  batch, and the logged loss (the mean over processes) is the full sequence's loss.

Process layouts (:mod:`upipe_compile.integrations.hf_layout`, with the set-up refusals):

- CPU or GPUs without ``ParallelismConfig``: DDP over all processes (accelerate's
  MULTI_CPU/MULTI_GPU), P = ``cp_size`` (default: all of them), data-parallel degree
  world / P; consecutive ranks form a context-parallel group. Tested on CPU with gloo.
- GPUs with accelerate's ``ParallelismConfig(cp_size=P)`` and FSDP2: upipe runs over
  ``accelerator.torch_device_mesh["cp"]`` and accelerate's own context parallelism (torch's
  ring attention and its mask hooks) is not installed. Not tested here (no GPU).

Refused, with the fix in the message, before any rank enters a collective: a padding mask
other than right padding, a sequence length that P does not divide (``pad_to_multiple_of=P``;
:class:`UPipeSFTTrainer` sets it on ``SFTConfig`` itself), ``inputs_embeds``, label smoothing,
a ``compute_loss_func``, ``average_tokens_across_devices=False``, a model whose loss is not
a causal LM's, DeepSpeed Ulysses SP (``ParallelismConfig(sp_size>1)``), tensor parallelism,
and FSDP or DeepSpeed without ``ParallelismConfig(cp_size=P)``. Attention upipe cannot
rewrite is refused by the backend when the first step compiles.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
from typing import Any, Optional

import torch
import torch.distributed as dist

from upipe_compile.errors import UnsupportedAttention
from upipe_compile.integrations.hf_batch import IGNORE_INDEX, upipe_batch
from upipe_compile.integrations.hf_layout import argument_problems, process_layout, with_kept_attention
from upipe_compile.sharding import sequence_multiple

logger = logging.getLogger(__name__)

def _groups_of(mesh) -> list:
    """The process groups of each dimension of a 1-D or 2-D mesh."""
    return [mesh.get_group(dim) for dim in range(mesh.ndim)]


def _map_tensors(data, fn):
    """``fn`` on every tensor of a nested tuple / list / dict (Trainer's logits, labels)."""
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, (tuple, list)):
        return type(data)(_map_tensors(d, fn) for d in data)
    if isinstance(data, dict):
        return {k: _map_tensors(v, fn) for k, v in data.items()}
    return data


def _lcm(a: int, b: int) -> int:
    import math

    return a * b // math.gcd(a, b)


class UPipeTrainerMixin:
    """Put before ``transformers.Trainer`` (or a subclass such as TRL's ``SFTTrainer``) in the
    bases: ``class MyTrainer(UPipeTrainerMixin, Trainer)``. Extra keyword arguments:

    - ``upipe_options``: the backend's options (``heads_per_stage``, ``inner_backend``, ...;
      ``cp_mesh`` is set here).
    - ``cp_size``: P, the context-parallel size, without ``ParallelismConfig`` (default: the
      number of processes; data parallelism over the rest). With ``ParallelismConfig`` its
      ``cp_size`` is P.
    - ``ring_degree``: R > 1 splits the P ranks into a ring of R groups of P / R consecutive
      ranks (all-to-all within a group, ring attention between them: several nodes), the
      sequence laid out zigzag over the ring; with ``ParallelismConfig(cp_size=P)`` its "cp"
      mesh dimension is split so (:func:`upipe_compile.integrations.hf_layout.ring_mesh`).
    - ``keep_attention``: with ``gradient_checkpointing=True``, the recompute in backward skips
      attention (:mod:`upipe_compile.stack.keep_attention`); the trainer works on a copy of the
      arguments with that ``context_fn``, never on the user's.
    - the long-context stack, off by default (:mod:`upipe_compile.integrations.hf_stack`):
      ``loss_chunk_tokens`` (output projection + loss in chunks of that many tokens),
      ``mlp_tile_tokens`` (the gated MLP over tiles), ``offload_block_inputs`` (checkpointed
      decoder-layer inputs to host memory, checked against the node's memory less
      ``host_memory_reserve_gib``: by default a quarter of the node's, at most 64 GiB).
    """

    def __init__(self, *args, upipe_options: Optional[dict[str, Any]] = None, cp_size: Optional[int] = None,
                 ring_degree: int = 1, keep_attention: bool = False, loss_chunk_tokens: int = 0,
                 mlp_tile_tokens: int = 0, offload_block_inputs: bool = False,
                 host_memory_reserve_gib: Optional[float] = None, **kwargs):
        from upipe_compile.integrations.hf_stack import StackSettings

        self._upipe_ring_degree = ring_degree
        self._upipe_keep_attention = keep_attention
        self._upipe_stack = StackSettings(loss_chunk_tokens, mlp_tile_tokens, offload_block_inputs,
                                          host_memory_reserve_gib)
        self._upipe_host_checked = set()  # tokens per rank whose offload was checked against host memory
        self._upipe_options = dict(upipe_options or {})
        if "cp_mesh" in self._upipe_options:
            raise UnsupportedAttention("upipe_options['cp_mesh'] is set by the trainer from its process layout; "
                                       "pass cp_size=P (or ParallelismConfig(cp_size=P)) instead")
        self._upipe_cp_size = cp_size
        self._upipe_world = 1  # P once set up; 1 = upipe inactive
        self._upipe_mesh = None
        self._upipe_replicas = None  # the data-parallel mesh over the context-parallel groups
        self._upipe_own_layout = False
        super().__init__(*args, **kwargs)
        self._upipe_setup()

    # ---- setup -----------------------------------------------------------------------------
    def _upipe_own_config(self, args: tuple, kwargs: dict, change) -> tuple[tuple, dict]:
        """The trainer's arguments with its config (``args=`` or the second positional) replaced by
        a copy that ``change`` edits in place: the user's config object stays as given. Reads
        ``cp_size`` first, which ``change`` may need (:meth:`_upipe_plan_size`)."""
        self._upipe_cp_size = kwargs.get("cp_size")
        in_args = "args" not in kwargs and len(args) > 1
        cfg = args[1] if in_args else kwargs.get("args")
        if cfg is None:
            return args, kwargs
        cfg = copy.copy(cfg)
        change(cfg)
        if in_args:
            return (args[0], cfg, *args[2:]), kwargs
        return args, {**kwargs, "args": cfg}

    def _upipe_plan_size(self, args) -> int:
        """P as known before the trainer is built (for collator settings)."""
        pc = getattr(args, "parallelism_config", None)
        if pc is not None and getattr(pc, "cp_size", 1) and pc.cp_size > 1:
            return pc.cp_size
        if self._upipe_cp_size is not None:
            return self._upipe_cp_size
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size()
        import os

        return int(os.environ.get("WORLD_SIZE", "1"))

    def _upipe_setup(self) -> None:
        from accelerate.utils import DistributedType

        acc = self.accelerator
        layout = process_layout(acc, self._upipe_cp_size, self._upipe_ring_degree)
        world, mesh = layout.world, layout.mesh
        self._upipe_replicas, self._upipe_own_layout = layout.replicas, layout.own
        self._upipe_world, self._upipe_mesh = world, mesh
        if self._upipe_keep_attention:
            self.args = with_kept_attention(self.args)

        if world > 1:
            problems = self._upipe_argument_problems()
            if problems:
                raise UnsupportedAttention("; ".join(problems))

        model = acc.unwrap_model(self.model)
        from upipe_compile.integrations.hf_stack import apply_stack

        # before the compile: the swapped modules are what it traces
        apply_stack(model, self._upipe_stack, self.args)
        if world == 1:
            if dist.is_initialized():
                self._upipe_switch_attention(model)
            logger.warning("upipe: context-parallel size 1, training without context parallelism")
            return
        if acc.distributed_type in (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU):
            # Dynamo's DDPOptimizer would split the compiled graph at DDP's bucket boundaries,
            # cutting attention blocks apart; DDP then all-reduces after backward, unoverlapped.
            torch._dynamo.config.optimize_ddp = False
        self._upipe_compile(model, layer_by_layer=self._upipe_stack.offload_block_inputs)

    def _upipe_argument_problems(self) -> list[str]:
        """What this trainer's arguments ask that the sharded step cannot honour."""
        return argument_problems(self)

    @staticmethod
    def _upipe_switch_attention(model) -> None:
        from upipe_compile.integrations.transformers import ATTN_IMPLEMENTATION, register

        register()
        if model.config._attn_implementation != ATTN_IMPLEMENTATION:
            logger.info("upipe: switching %s from attn_implementation=%r to %r", type(model).__name__,
                        model.config._attn_implementation, ATTN_IMPLEMENTATION)
            model.set_attn_implementation(ATTN_IMPLEMENTATION)

    def _upipe_compile(self, model, layer_by_layer: bool = False) -> None:
        """``model``'s backbone compiled in place with ``backend="upipe"`` over the group (or each
        decoder layer on its own, so that the offloader's hooks stay outside the compiled code)."""
        from upipe_compile.integrations.hf_stack import compile_layers

        self._upipe_switch_attention(model)
        options = {**self._upipe_options, "cp_mesh": self._upipe_mesh}
        if layer_by_layer:
            compile_layers(model, backend="upipe", options=options)
            return
        backbone = getattr(model, "base_model", model)
        if getattr(backbone, "_compiled_call_impl", None) is None:
            backbone.compile(backend="upipe", options=options)

    # ---- Trainer hooks ----------------------------------------------------------------------
    def get_cp_size(self) -> int:
        # Trainer's data-parallel size is the processes over this (P ranks hold one batch).
        return self._upipe_world if self._upipe_own_layout else super().get_cp_size()

    def training_step(self, *args, **kwargs) -> torch.Tensor:
        """Trainer's step, its (detached) loss made the context-parallel group's (see
        :meth:`_upipe_group_loss`) before Trainer's ``logging_nan_inf_filter`` reads it."""
        loss = super().training_step(*args, **kwargs)
        return loss if self._upipe_world == 1 else self._upipe_group_loss(loss)

    def _upipe_group_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The micro-batch's loss as the mean over its context-parallel group: the same on every rank
        of the group, and non-finite on all of them when any rank's shard is, so that Trainer's
        non-finite filter decides alike on every rank. The mean of the P shard losses, which Trainer
        then averages over all processes to log, logs what the shard losses did. One scalar
        all-reduce on the device, no host sync. A non-finite gradient needs nothing more: DDP's
        all-reduce (FSDP's reduce-scatter, then the clipping norm's all-reduce) carries it to every
        rank in the same step."""
        loss = loss.detach().clone()
        for group in _groups_of(self._upipe_mesh):  # over every rank of the group: each dimension in turn
            dist.all_reduce(loss, group=group)
        return loss / self._upipe_world

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device):
        """The labelled tokens of the optimizer step over all processes, each batch counted
        once although its P context-parallel ranks all hold it. Counted here: transformers
        releases differ in whether Trainer divides by the context-parallel size without
        ParallelismConfig (5.17 does not, and the loss came out 1/P of the right one)."""
        if not (self._upipe_own_layout and self._upipe_world > 1) or not batch_samples \
                or "labels" not in batch_samples[0]:
            return super()._get_num_items_in_batch(batch_samples, device)
        labels = [batch["shift_labels"] if "shift_labels" in batch else batch["labels"][..., 1:]
                  for batch in batch_samples]
        count = sum(label.ne(IGNORE_INDEX).sum() for label in labels).to(device)
        return self.accelerator.gather(count).sum() / self._upipe_world

    def _get_dataloader(self, *args, **kwargs):
        """Without ParallelismConfig, accelerate would give each process different samples:
        shard the data over the data-parallel replicas only, the same batches on every
        context-parallel rank."""
        if not self._upipe_own_layout:
            return super()._get_dataloader(*args, **kwargs)
        acc = self.accelerator
        prepare = acc.prepare
        replicas = acc.num_processes // self._upipe_world
        replica = acc.process_index // self._upipe_world

        def prepare_replica(loader, *rest, **kw):
            from accelerate.data_loader import prepare_data_loader

            if rest or kw or not isinstance(loader, torch.utils.data.DataLoader):
                return prepare(loader, *rest, **kw)
            prepared = prepare_data_loader(
                loader, acc.device, num_processes=replicas, process_index=replica, split_batches=acc.split_batches,
                put_on_device=acc.device_placement, rng_types=acc.rng_types.copy(),
                dispatch_batches=acc.dispatch_batches, even_batches=acc.even_batches,
                use_seedable_sampler=acc.use_seedable_sampler, data_seed=acc.dataloader_config.data_seed,
                non_blocking=acc.non_blocking, use_stateful_dataloader=acc.use_stateful_dataloader)
            acc._dataloaders.append(prepared)
            return prepared

        acc.prepare = prepare_replica
        try:
            return super()._get_dataloader(*args, **kwargs)
        finally:
            del acc.prepare

    def prediction_step(self, model, inputs, prediction_loss_only: bool, ignore_keys=None):
        """Trainer's evaluation step on this rank's shard, made the whole batch's on every rank
        of its context-parallel group: the loss summed over the shards (each is its labelled
        tokens' sum over the batch's count, times the processes as Trainer scales it; the P
        ranks of a group count as one), the logits gathered over the sequence."""
        loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        if self._upipe_world == 1:
            return loss, logits, labels
        from upipe_compile.sharding import gather_sequence

        if loss is not None:
            loss = loss.clone()
            for group in _groups_of(self._upipe_mesh):  # over every rank of the group: each dimension in turn
                dist.all_reduce(loss, group=group)
            loss = loss / self._upipe_world
        if logits is not None:
            logits = _map_tensors(logits, lambda t: gather_sequence(t.contiguous(), self._upipe_mesh, dim=1))
        return loss, logits, labels

    def evaluation_loop(self, *args, **kwargs):
        if self._upipe_own_layout and self._upipe_world > 1:
            # Trainer resets its gather function after every loop
            self.gather_function = self._upipe_gather_over_replicas
        return super().evaluation_loop(*args, **kwargs)

    def _upipe_gather_over_replicas(self, data):
        """Trainer's metric gather (``accelerator.gather_for_metrics``) for our layout: every rank
        of a context-parallel group holds the same rows, so they are gathered over the
        data-parallel replicas only (once per row), and the last batch's padding rows that
        accelerate added across the replicas are cut as it cuts them."""
        group = None if self._upipe_replicas is None or self._upipe_replicas.size() == 1 \
            else self._upipe_replicas.get_group()

        def gather(t):
            if group is None:
                return t
            parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, t.contiguous(), group=group)
            return torch.cat(parts)

        gathered = _map_tensors(data, gather)
        state = self.accelerator.gradient_state
        if group is not None and state.end_of_dataloader and state.remainder > 0:
            gathered = _map_tensors(gathered, lambda t: t[: state.remainder])
        return gathered

    def _upipe_batch(self, inputs):
        """This rank's shard of the batch, checked; also against host memory with offload."""
        batch = upipe_batch(inputs, self._upipe_mesh, world=self._upipe_world)
        self._upipe_check_host(batch)
        return batch

    def _upipe_check_host(self, batch) -> None:
        tokens = batch["input_ids"].numel() if isinstance(batch.get("input_ids"), torch.Tensor) else None
        if self._upipe_stack.offload_block_inputs and tokens and tokens not in self._upipe_host_checked:
            from upipe_compile.integrations.hf_stack import check_host_memory

            processes = dist.get_world_size() if dist.is_initialized() else 1  # all of them, whatever view
            check_host_memory(self.accelerator.unwrap_model(self.model), self._upipe_stack, tokens, processes)
            self._upipe_host_checked.add(tokens)

    def _prepare_context_parallel_inputs(self, model, inputs):
        if self._upipe_world == 1:
            context, batch = super()._prepare_context_parallel_inputs(model, inputs)
            self._upipe_check_host(batch)
            return context, batch
        if self.accelerator.num_processes == self._upipe_world:
            # one context-parallel group: every rank checks the same batch and raises alike
            return contextlib.nullcontext, self._upipe_batch(inputs)
        # Data-parallel replicas check different batches: a refusal on one replica is raised on
        # every process (one host all-gather), not left to hang the others in the next collective.
        from upipe_compile.attention.collectives import host_values_of_every_rank

        try:
            batch, error = self._upipe_batch(inputs), None
        except UnsupportedAttention as e:
            batch, error = None, e
        refused = [rank for rank, (flag,) in enumerate(host_values_of_every_rank([error is not None],
                                                                                  dist.group.WORLD)) if flag]
        if error is not None:
            raise error
        if refused:
            raise UnsupportedAttention(f"the batch was refused on process(es) {refused} (their error says why); "
                                       "every process stops with them")
        return contextlib.nullcontext, batch


@functools.lru_cache(maxsize=None)
def _trainer_class():
    from transformers import Trainer

    class UPipeTrainer(UPipeTrainerMixin, Trainer):
        """``transformers.Trainer`` with UPipe context parallelism (see :class:`UPipeTrainerMixin`)."""

    UPipeTrainer.__qualname__ = "UPipeTrainer"
    return UPipeTrainer


@functools.lru_cache(maxsize=None)
def _sft_trainer_class():
    from trl import SFTTrainer

    class UPipeSFTTrainer(UPipeTrainerMixin, SFTTrainer):
        """TRL's ``SFTTrainer`` with UPipe context parallelism (see :class:`UPipeTrainerMixin`).
        Sets ``SFTConfig.pad_to_multiple_of`` to a multiple of P, so that every batch divides."""

        def __init__(self, *args, **kwargs):
            if kwargs.get("loss_chunk_tokens"):
                raise UnsupportedAttention(
                    "loss_chunk_tokens: TRL's SFTTrainer already computes its loss through its fused LM head, in "
                    "token chunks, never the whole logits; leave loss_chunk_tokens=0 (it is for UPipeTrainer)")
            def pad_to_multiple(cfg):
                size = sequence_multiple(self._upipe_plan_size(cfg), kwargs.get("ring_degree", 1))
                multiple = cfg.pad_to_multiple_of or 1
                if size > 1 and multiple % size:
                    cfg.pad_to_multiple_of = _lcm(multiple, size)
                    logger.info("upipe: SFTConfig.pad_to_multiple_of=%d (a multiple of P=%d)",
                                cfg.pad_to_multiple_of, size)

            args, kwargs = self._upipe_own_config(args, kwargs, pad_to_multiple)
            super().__init__(*args, **kwargs)

    UPipeSFTTrainer.__qualname__ = "UPipeSFTTrainer"
    return UPipeSFTTrainer


@functools.lru_cache(maxsize=None)
def _grpo_trainer_class():
    from upipe_compile.integrations.hf_grpo import grpo_trainer_class

    return grpo_trainer_class(UPipeTrainerMixin)


def __getattr__(name: str):
    # transformers and trl are imported only when these classes are asked for.
    if name == "UPipeTrainer":
        return _trainer_class()
    if name == "UPipeSFTTrainer":
        return _sft_trainer_class()
    if name == "UPipeGRPOTrainer":
        return _grpo_trainer_class()
    raise AttributeError(name)
