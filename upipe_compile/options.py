"""Option values: the backend's options (validated once when torch.compile calls the
backend) and the one check of every option value. The ops' settings records live beside
the ops (:class:`~upipe_compile.attention.stage_loop.StageLoopSettings`,
:class:`~upipe_compile.block.ops.BlockSettings`)."""

from __future__ import annotations

import functools

from dataclasses import dataclass, fields
from typing import Any, Optional

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from upipe_compile.attention.collectives import resolve_groups
from upipe_compile.errors import UnsupportedAttention
from upipe_compile.attention.kernels import NO_WINDOW, check_variant
from upipe_compile.attention.stage_loop import DEFAULT_PREFETCH, PREFETCH_MODES

# aot_eager_decomp_partition: inductor's decompositions and min-cut partitioner with eager
# kernels, what tells the partitioner's effect from inductor's (benchmarks/estimate_check.py).
INNER_BACKENDS = ("inductor", "aot_eager", "eager", "aot_eager_decomp_partition")

# The defaults of the options that are not the stage loop's own (DEFAULT_PREFETCH is), for
# UPipeOptions, the public functions and the torchtitan [upipe] section alike.
DEFAULT_INNER_BACKEND = INNER_BACKENDS[0]
DEFAULT_FUSE_PROJECTIONS = True
DEFAULT_RECOMPUTE_ATTENTION_OUTPUT = False


def normalised_variant(window, softcap) -> tuple[int, int, float]:
    """``(window_left, window_right, softcap)`` as the ops take them (None: no window / no
    softcap), or UnsupportedAttention for bad values (:func:`upipe_compile.attention.kernels.check_variant`;
    a softcap the caller gives must be > 0: 0 is the ops' "off", spelled None here)."""
    if softcap is not None and not isinstance(softcap, bool) and isinstance(softcap, (int, float)) and softcap <= 0:
        raise UnsupportedAttention(f"softcap={softcap!r}: must be > 0 (None for no softcap)")
    (left, right), softcap = check_variant(NO_WINDOW if window is None else window, 0.0 if softcap is None else softcap)
    return left, right, softcap


def option_problems(*, world: Optional[int] = None, heads_per_stage=None, prefetch=DEFAULT_PREFETCH,
                    inner_backend=DEFAULT_INNER_BACKEND, fuse_projections=DEFAULT_FUSE_PROJECTIONS,
                    recompute_attention_output=DEFAULT_RECOMPUTE_ATTENTION_OUTPUT) -> list[str]:
    """What is wrong with these option values (empty: nothing), each naming the option: the
    one check of every option, for :class:`UPipeOptions`, the public functions and the
    torchtitan ``[upipe]`` section alike. ``heads_per_stage`` None is the default (P)."""
    problems = []
    if inner_backend not in INNER_BACKENDS:
        problems.append(f"inner_backend={inner_backend!r} is not one of {INNER_BACKENDS}")
    if prefetch not in PREFETCH_MODES:
        problems.append(f"prefetch={prefetch!r} is not one of {PREFETCH_MODES}")
    for name, value in (("fuse_projections", fuse_projections), ("recompute_attention_output", recompute_attention_output)):
        if not isinstance(value, bool):
            problems.append(f"{name} must be True or False, got {value!r}")
    if recompute_attention_output is True and fuse_projections is False:
        problems.append("recompute_attention_output=True acts on fused attention blocks only: it needs "
                        "fuse_projections=True")
    if heads_per_stage is not None:
        if isinstance(heads_per_stage, bool) or not isinstance(heads_per_stage, int):
            problems.append(f"heads_per_stage must be an int, got {heads_per_stage!r}")
        elif world is not None and (heads_per_stage < 1 or heads_per_stage % world):
            problems.append(f"heads_per_stage={heads_per_stage} must be a positive multiple of the "
                            f"context-parallel size P={world} (each rank computes heads_per_stage/P heads per stage)")
    return problems


def resolved_heads_per_stage(heads_per_stage: Optional[int], world: int) -> int:
    """U: ``heads_per_stage``, or P where it is None (the default: least memory)."""
    return world if heads_per_stage is None else heads_per_stage


@dataclass(frozen=True)
class UPipeOptions:
    cp_mesh: DeviceMesh | dist.ProcessGroup | None = None
    """1-D DeviceMesh or ProcessGroup of the context-parallel ranks; None = default group. A
    2-D DeviceMesh named ("cp_ring", "cp_a2a") is ring x all-to-all: the all-to-all runs over
    "cp_a2a" (U counts its ranks) and each stage's attention as ring attention over "cp_ring",
    in the plain op and in fused blocks alike."""
    heads_per_stage: int | None = None
    """U: query heads per stage across all ranks, a multiple of P; None = P (least memory).
    U = number of query heads is plain Ulysses."""
    inner_backend: str = DEFAULT_INNER_BACKEND
    """What compiles the graph after the UPipe passes: inductor, aot_eager or eager."""
    prefetch: str = DEFAULT_PREFETCH
    """Start the next stage's all-to-alls while this stage's attention runs: "forward"
    (no extra peak memory for GQA; MHA +1 full-sequence head), "both" (backward too; about
    U = 2P's memory) or "none"."""
    fuse_projections: bool = DEFAULT_FUSE_PROJECTIONS
    """Fuse each whole attention block (q/k/v projections, their per-head ops, attention and
    the output projection) into one stage loop (``upipe::attention_block``) where the block is
    head-separable; other SDPA calls get the plain attention op."""
    recompute_attention_output: bool = DEFAULT_RECOMPUTE_ATTENTION_OUTPUT
    """Fused blocks keep no attention output for backward (one activation of the block's
    input size, Hq x head_dim features, per block in flight): each stage's attention forward
    runs again in backward instead. Less memory, one more attention forward per block."""

    @classmethod
    def from_user(cls, options: dict[str, Any] | "UPipeOptions" | None) -> "UPipeOptions":
        if isinstance(options, cls):
            return options
        options = dict(options or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise UnsupportedAttention(f"unknown upipe option(s) {unknown}; known options: {sorted(known)}")
        return cls(**options)

    def __post_init__(self):
        world = self.group.size() if self.heads_per_stage is not None else None
        problems = option_problems(world=world, heads_per_stage=self.heads_per_stage, prefetch=self.prefetch,
                                   inner_backend=self.inner_backend, fuse_projections=self.fuse_projections,
                                   recompute_attention_output=self.recompute_attention_output)
        if problems:
            raise UnsupportedAttention("; ".join(problems))

    @functools.cached_property
    def _groups(self) -> tuple:
        return resolve_groups(self.cp_mesh)  # resolved once per options object

    @property
    def group(self) -> dist.ProcessGroup:
        """The all-to-all group (the whole context-parallel group without a ring)."""
        return self._groups[0]

    @property
    def ring_group(self) -> dist.ProcessGroup | None:
        """The ring group of a ring x all-to-all mesh; None otherwise."""
        return self._groups[1]

    def stage_heads(self) -> int:
        return resolved_heads_per_stage(self.heads_per_stage, self.group.size())
