"""Hugging Face ``Trainer`` and TRL's ``SFTTrainer`` with UPipe context parallelism.

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
- data: every context-parallel rank gets the SAME batch; each batch is validated on the full
  sequence, labels are shifted on the full sequence (``shift_labels``, last position -100)
  and then every per-token tensor is cut into contiguous shards (rank r holds tokens
  ``[r S/P, (r + 1) S/P)``, as :func:`upipe_compile.shard_sequence`); position ids are
  kept (global positions, or per document for packed rows), and the documents' boundaries
  ``cu_seq_lens_q/k`` come from the full sequence's position ids and are never sharded.
- loss: each rank's loss is the sum of its tokens' losses over the number of labelled tokens
  in the whole optimizer step (all micro-batches of gradient accumulation, all data-parallel
  replicas, each counted once although P ranks see it), passed as Trainer's
  ``num_items_in_batch`` (counted by the mixin: transformers releases count it differently
  under context parallelism). Trainer multiplies it by the number of processes and DDP/FSDP
  average gradients over them, so the gradient is the token-weighted mean over the global
  batch, and the logged loss (the mean over processes) is the full sequence's loss.

Process layouts:

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

logger = logging.getLogger(__name__)

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
    from upipe_compile.packed.documents import cu_seqlens_from_position_ids
    from upipe_compile.sharding import shard_sequence

    ring = cp_mesh is not None and getattr(cp_mesh, "ndim", 1) == 2  # ring x all-to-all: two zigzag chunks a ring rank
    if world is None:
        groups = resolve_groups(cp_mesh)
        world = groups[0].size() * (1 if groups[1] is None else groups[1].size())
    multiple = world * (2 if ring else 1)
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
        layout = f"the context-parallel size {world}" + (" x 2 (two zigzag chunks a ring rank)" if ring else "")
        raise UnsupportedAttention(
            f"sequence length {length} is not divisible by {layout}: pad every batch to a "
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
    for name, value in inputs.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == (batch, length) \
                and not name.startswith("cu_seq_lens"):
            # contiguous: the model's loss views its labels (shift_labels.view(-1))
            out[name] = shard_sequence(value, cp_mesh, dim=1).contiguous() if world > 1 else value
        else:
            out[name] = value
    return out


def ring_mesh(cp_mesh, ring: int):
    """accelerate's "cp" mesh dimension as UPipeTrainer's ring layout: ``ring`` groups of
    ``P / ring`` consecutive ranks ("cp_ring" x "cp_a2a": all-to-all within a group, ring attention
    between them, as the DDP layout makes them); ``ring`` = 1: the mesh as it is."""
    size = cp_mesh.size()
    if ring < 1 or size % ring:
        raise UnsupportedAttention(f"ring_degree={ring} must be >= 1 and divide ParallelismConfig(cp_size={size})")
    if ring == 1:
        return cp_mesh
    if not hasattr(cp_mesh, "_unflatten"):
        raise UnsupportedAttention(
            f"ring_degree={ring} with ParallelismConfig(cp_size={size}) splits accelerate's cp mesh dimension, which "
            f"this torch ({torch.__version__}) cannot do (DeviceMesh._unflatten): upgrade torch, or pass cp_size= and "
            "ring_degree= to the trainer without ParallelismConfig (DDP)")
    return cp_mesh._unflatten(0, (ring, size // ring), ("cp_ring", "cp_a2a"))


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
      mesh dimension is split so (:func:`ring_mesh`).
    - ``keep_attention``: with ``gradient_checkpointing=True``, the recompute in backward skips
      attention (:mod:`upipe_compile.stack.keep_attention`); the trainer works on a copy of the
      arguments with that ``context_fn``, never on the user's.
    - the long-context stack, off by default (:mod:`upipe_compile.integrations.hf_stack`):
      ``loss_chunk_tokens`` (output projection + loss in chunks of that many tokens),
      ``mlp_tile_tokens`` (the gated MLP over tiles), ``offload_block_inputs`` (checkpointed
      decoder-layer inputs to host memory, checked against ``host_memory_reserve_gib``).
    """

    def __init__(self, *args, upipe_options: Optional[dict[str, Any]] = None, cp_size: Optional[int] = None,
                 ring_degree: int = 1, keep_attention: bool = False, loss_chunk_tokens: int = 0,
                 mlp_tile_tokens: int = 0, offload_block_inputs: bool = False,
                 host_memory_reserve_gib: Optional[float] = None, **kwargs):
        from upipe_compile.integrations.hf_stack import StackSettings

        self._upipe_ring_degree = ring_degree
        self._upipe_keep_attention = keep_attention
        reserve = {} if host_memory_reserve_gib is None else {"host_memory_reserve_gib": host_memory_reserve_gib}
        self._upipe_stack = StackSettings(loss_chunk_tokens, mlp_tile_tokens, offload_block_inputs, **reserve)
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
        from torch.distributed.device_mesh import init_device_mesh

        from upipe_compile.integrations.transformers import ATTN_IMPLEMENTATION, register

        acc = self.accelerator
        pc = getattr(acc, "parallelism_config", None)
        if pc is not None and getattr(pc, "sp_size", 1) > 1:
            raise UnsupportedAttention(
                f"ParallelismConfig(sp_size={pc.sp_size}, sp_backend={pc.sp_backend!r}) is DeepSpeed's Ulysses "
                "sequence parallelism, which upipe replaces: use ParallelismConfig(cp_size=P) with FSDP2 on GPUs, "
                "or no ParallelismConfig (cp_size= on the trainer) with DDP")
        if pc is not None and getattr(pc, "tp_size", 1) > 1:
            raise UnsupportedAttention(
                f"ParallelismConfig(tp_size={pc.tp_size}): tensor parallelism with upipe's context parallelism is "
                "not supported yet")
        ring = self._upipe_ring_degree
        if pc is not None and pc.cp_enabled:
            if self._upipe_cp_size not in (None, pc.cp_size):
                raise UnsupportedAttention(
                    f"cp_size={self._upipe_cp_size} but ParallelismConfig(cp_size={pc.cp_size}): give P once")
            world, mesh = pc.cp_size, ring_mesh(acc.torch_device_mesh["cp"], ring)
            # Not torch's ring attention and accelerate's mask hooks: upipe is the context parallelism.
            acc._prepare_cp = lambda *objs: objs
        else:
            processes = acc.num_processes
            world = self._upipe_cp_size or processes
            if processes % world:
                raise UnsupportedAttention(
                    f"cp_size={world} does not divide the {processes} processes")
            if world > 1 and acc.distributed_type not in (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU):
                raise UnsupportedAttention(
                    f"upipe's trainer runs under DDP (MULTI_CPU/MULTI_GPU) or accelerate's "
                    f"ParallelismConfig(cp_size=P) with FSDP2; got {acc.distributed_type}: with FSDP2 pass "
                    f"TrainingArguments(parallelism_config=ParallelismConfig(dp_shard_size=..., cp_size={world}))")
            if ring < 1 or world % ring:
                raise UnsupportedAttention(f"ring_degree={ring} must be >= 1 and divide cp_size={world}")
            mesh = None
            if world > 1:
                device_type = "cpu" if acc.device.type == "cpu" else acc.device.type
                if ring == 1:
                    layout = init_device_mesh(device_type, (processes // world, world), mesh_dim_names=("dp", "cp"))
                    mesh = layout["cp"]
                else:
                    layout = init_device_mesh(device_type, (processes // world, ring, world // ring),
                                              mesh_dim_names=("dp", "cp_ring", "cp_a2a"))
                    mesh = layout["cp_ring", "cp_a2a"]
                self._upipe_replicas = layout["dp"]
                self._upipe_own_layout = True
        self._upipe_world, self._upipe_mesh = world, mesh
        if self._upipe_keep_attention:
            self.args = _with_kept_attention(self.args)

        args = self.args
        if world > 1:
            if getattr(args, "label_smoothing_factor", 0) > 0:
                raise UnsupportedAttention(
                    "label_smoothing_factor > 0 shifts labels inside each shard; not supported with upipe's context "
                    "parallelism: set label_smoothing_factor=0")
            if self.compute_loss_func is not None:
                raise UnsupportedAttention(
                    "compute_loss_func receives one shard's unshifted labels under context parallelism; not "
                    "supported with upipe: use the model's loss (shift_labels and num_items_in_batch reach it)")
            if not args.average_tokens_across_devices:
                raise UnsupportedAttention(
                    "average_tokens_across_devices=False would weight each rank's shard by its own token count: "
                    "set average_tokens_across_devices=True")
            if not getattr(self, "_loss_shifts_labels", False) or not self.model_accepts_loss_kwargs:
                raise UnsupportedAttention(
                    f"{type(self.model).__name__} is not a causal LM whose loss takes shift_labels and "
                    "num_items_in_batch (transformers' ForCausalLMLoss): upipe's trainer supports causal LMs")

        model = acc.unwrap_model(self.model)
        from upipe_compile.integrations.hf_stack import apply_stack, compile_layers

        # before the compile: the swapped modules are what it traces
        apply_stack(model, self._upipe_stack, self.args)
        if world > 1 or dist.is_initialized():
            register()
            if model.config._attn_implementation != ATTN_IMPLEMENTATION:
                logger.info("upipe: switching %s from attn_implementation=%r to %r", type(model).__name__,
                            model.config._attn_implementation, ATTN_IMPLEMENTATION)
                model.set_attn_implementation(ATTN_IMPLEMENTATION)
        if world == 1:
            logger.warning("upipe: context-parallel size 1, training without context parallelism")
            return
        if acc.distributed_type in (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU):
            # Dynamo's DDPOptimizer would split the compiled graph at DDP's bucket boundaries,
            # cutting attention blocks apart; DDP then all-reduces after backward, unoverlapped.
            torch._dynamo.config.optimize_ddp = False
        options = {**self._upipe_options, "cp_mesh": mesh}
        if self._upipe_stack.offload_block_inputs:
            compile_layers(model, backend="upipe", options=options)  # the offload hooks stay outside
            return
        backbone = getattr(model, "base_model", model)
        if getattr(backbone, "_compiled_call_impl", None) is None:
            backbone.compile(backend="upipe", options=options)

    # ---- Trainer hooks ----------------------------------------------------------------------
    def get_cp_size(self) -> int:
        # Trainer's data-parallel size is the processes over this (P ranks hold one batch).
        return self._upipe_world if self._upipe_own_layout else super().get_cp_size()

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

            check_host_memory(self.accelerator.unwrap_model(self.model), self._upipe_stack, tokens,
                              self.accelerator.num_processes)
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


def _with_kept_attention(args):
    """A copy of ``args`` whose gradient checkpointing keeps upipe's attention outputs.
    transformers 5.x names the settings ``activation_checkpointing(_kwargs)``, earlier releases
    ``gradient_checkpointing(_kwargs)``."""
    import copy

    from upipe_compile.stack.keep_attention import keep_attention

    prefix = "activation" if hasattr(args, "activation_checkpointing_kwargs") else "gradient"
    kwargs = dict(getattr(args, f"{prefix}_checkpointing_kwargs") or {})
    if not getattr(args, f"{prefix}_checkpointing"):
        raise UnsupportedAttention(f"keep_attention=True needs TrainingArguments({prefix}_checkpointing=True): "
                                   "without a recompute attention runs once anyway")
    if kwargs.get("use_reentrant", False) or kwargs.get("context_fn") not in (None, keep_attention):
        raise UnsupportedAttention(
            f"keep_attention=True sets {prefix}_checkpointing_kwargs' context_fn and needs use_reentrant=False; "
            f"got {kwargs}")
    kept = copy.copy(args)
    setattr(kept, f"{prefix}_checkpointing_kwargs", {**kwargs, "use_reentrant": False, "context_fn": keep_attention})
    return kept


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
            in_args = "args" not in kwargs and len(args) > 1
            cfg = args[1] if in_args else kwargs.get("args")
            self._upipe_cp_size = kwargs.get("cp_size")
            if cfg is not None:
                size = self._upipe_plan_size(cfg) * (2 if kwargs.get("ring_degree", 1) > 1 else 1)  # zigzag chunks
                multiple = cfg.pad_to_multiple_of or 1
                if size > 1 and multiple % size:
                    cfg = copy.copy(cfg)  # the trainer's own copy: the user's config object stays as given
                    cfg.pad_to_multiple_of = _lcm(multiple, size)
                    logger.info("upipe: SFTConfig.pad_to_multiple_of=%d (a multiple of P=%d)",
                                cfg.pad_to_multiple_of, size)
                    if in_args:
                        args = (args[0], cfg, *args[2:])
                    else:
                        kwargs["args"] = cfg
            super().__init__(*args, **kwargs)

    UPipeSFTTrainer.__qualname__ = "UPipeSFTTrainer"
    return UPipeSFTTrainer


def __getattr__(name: str):
    # transformers and trl are imported only when these classes are asked for.
    if name == "UPipeTrainer":
        return _trainer_class()
    if name == "UPipeSFTTrainer":
        return _sft_trainer_class()
    raise AttributeError(name)
