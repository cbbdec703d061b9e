"""The process layout and the set-up refusals of the Trainer path: which processes form a
context-parallel group and over which mesh, and what in the trainer's arguments upipe's context
parallelism cannot honour, refused before any rank enters a collective.

- With accelerate's ``ParallelismConfig(cp_size=P)`` (FSDP2 on GPUs): its "cp" mesh dimension,
  split into a ring (:func:`ring_mesh`) with ``ring_degree`` > 1.
- Without it (DDP, MULTI_CPU / MULTI_GPU): our own ``("dp", "cp")`` mesh over all processes,
  consecutive ranks a group, or ``("dp", "cp_ring", "cp_a2a")`` with a ring.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Optional

import torch

from upipe_compile.errors import UnsupportedAttention


@dataclass
class ProcessLayout:
    """P and its mesh; with our own (DDP) layout also the data-parallel mesh over the groups."""

    world: int
    """P, the context-parallel ranks of a group; 1: upipe inactive."""
    mesh: Any = None
    replicas: Any = None
    own: bool = False
    """The layout is ours (no ParallelismConfig): the trainer shards data over the replicas only."""


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


def process_layout(accelerator, cp_size: Optional[int], ring: int) -> ProcessLayout:
    """The layout of ``accelerator``'s processes, or the refusal naming the fix."""
    from accelerate.utils import DistributedType
    from torch.distributed.device_mesh import init_device_mesh

    acc = accelerator
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
    if pc is not None and pc.cp_enabled:
        if cp_size not in (None, pc.cp_size):
            raise UnsupportedAttention(f"cp_size={cp_size} but ParallelismConfig(cp_size={pc.cp_size}): give P once")
        # Not torch's ring attention and accelerate's mask hooks: upipe is the context parallelism.
        acc._prepare_cp = lambda *objs: objs
        return ProcessLayout(pc.cp_size, ring_mesh(acc.torch_device_mesh["cp"], ring))
    processes = acc.num_processes
    world = cp_size or processes
    if processes % world:
        raise UnsupportedAttention(f"cp_size={world} does not divide the {processes} processes")
    if world > 1 and acc.distributed_type not in (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU):
        raise UnsupportedAttention(
            f"upipe's trainer runs under DDP (MULTI_CPU/MULTI_GPU) or accelerate's "
            f"ParallelismConfig(cp_size=P) with FSDP2; got {acc.distributed_type}: with FSDP2 pass "
            f"TrainingArguments(parallelism_config=ParallelismConfig(dp_shard_size=..., cp_size={world}))")
    if ring < 1 or world % ring:
        raise UnsupportedAttention(f"ring_degree={ring} must be >= 1 and divide cp_size={world}")
    if world == 1:
        return ProcessLayout(1)
    device_type = "cpu" if acc.device.type == "cpu" else acc.device.type
    if ring == 1:
        layout = init_device_mesh(device_type, (processes // world, world), mesh_dim_names=("dp", "cp"))
        mesh = layout["cp"]
    else:
        layout = init_device_mesh(device_type, (processes // world, ring, world // ring),
                                  mesh_dim_names=("dp", "cp_ring", "cp_a2a"))
        mesh = layout["cp_ring", "cp_a2a"]
    return ProcessLayout(world, mesh, layout["dp"], own=True)


def argument_problems(trainer) -> list[str]:
    """What a context-parallel Trainer's arguments ask that the sharded step cannot honour."""
    args, out = trainer.args, []
    if getattr(args, "label_smoothing_factor", 0) > 0:
        out.append("label_smoothing_factor > 0 shifts labels inside each shard; not supported with upipe's context "
                   "parallelism: set label_smoothing_factor=0")
    if trainer.compute_loss_func is not None:
        out.append("compute_loss_func receives one shard's unshifted labels under context parallelism; not "
                   "supported with upipe: use the model's loss (shift_labels and num_items_in_batch reach it)")
    if not args.average_tokens_across_devices:
        out.append("average_tokens_across_devices=False would weight each rank's shard by its own token count: "
                   "set average_tokens_across_devices=True")
    if not getattr(trainer, "_loss_shifts_labels", False) or not trainer.model_accepts_loss_kwargs:
        out.append(f"{type(trainer.model).__name__} is not a causal LM whose loss takes shift_labels and "
                   "num_items_in_batch (transformers' ForCausalLMLoss): upipe's trainer supports causal LMs")
    return out


def with_kept_attention(args):
    """A copy of ``args`` whose gradient checkpointing keeps upipe's attention outputs.
    transformers 5.x names the settings ``activation_checkpointing(_kwargs)``, earlier releases
    ``gradient_checkpointing(_kwargs)``."""
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
