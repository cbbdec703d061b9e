"""Which heads each rank computes in each stage (pure arithmetic, no tensors).

Notation: P ranks, Hq query heads, Hkv KV heads, U query heads per stage across all ranks
(U = m * P, so each rank takes m query heads per stage).

KV heads are first replicated up to ``Hkv' = lcm(Hkv, P)`` (a no-op when P divides Hkv),
so that every rank can own whole KV heads; replica ``j`` is original head ``j // rep``.
With ``g = Hq / Hkv'`` query heads per (replicated) KV head, query head ``h`` uses replica
``h // g``, which is original head ``h // (Hq / Hkv)``: SDPA's GQA rule is preserved.

Stages are grouped by KV group: a group gives each rank ``k`` KV heads (all-to-all'd once),
and the group's ``g * k`` query heads per rank are split into stages of ``m``. With U = P
and k = 1 this is the paper's schedule:
``kv_head(s, r) = (s // g) * P + r`` and ``q_head(s, r) = kv_head(s, r) * g + s % g``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass


class ScheduleError(ValueError):
    """The head counts cannot be scheduled for this P and U (message says why)."""


@dataclass(frozen=True)
class Stage:
    q_heads: tuple[int, ...]
    """Query heads of this stage, ``m`` per rank, ordered by the rank that computes them."""
    kv_group: int
    """Index into :attr:`StageSchedule.kv_groups` of the KV heads this stage reads."""
    kv_slots: tuple[int, ...]
    """For each of a rank's ``m`` query heads, which of its ``k`` received KV heads it uses."""

    @property
    def kv_slot_range(self) -> tuple[int, int] | None:
        """``(a, b)`` when query head i uses KV slot ``a + i // (m // (b - a))`` — the plain
        GQA layout a kernel handles natively — else None (slots must be gathered)."""
        a, b = self.kv_slots[0], self.kv_slots[-1] + 1
        m, span = len(self.kv_slots), b - a
        if m % span:
            return None
        per = m // span
        return (a, b) if all(slot == a + i // per for i, slot in enumerate(self.kv_slots)) else None


@dataclass(frozen=True)
class StageSchedule:
    world: int
    q_heads: int
    kv_heads: int
    heads_per_stage: int
    q_per_rank: int
    """m: query heads per rank per stage."""
    kv_per_rank: int
    """k: KV heads per rank per KV group."""
    kv_groups: tuple[tuple[int, ...], ...]
    """Per group, the original KV head each rank receives, ``k`` per rank, ordered by rank."""
    stages: tuple[Stage, ...]

    def opens_kv_group(self, index: int) -> bool:
        """Stage ``index`` is the first of its KV group (its K/V must be exchanged)."""
        return index == 0 or self.stages[index].kv_group != self.stages[index - 1].kv_group

    def closes_kv_group(self, index: int) -> bool:
        """Stage ``index`` is the last of its KV group (the group's dK/dV are complete)."""
        return index + 1 == len(self.stages) or self.opens_kv_group(index + 1)

    def lse_shape(self, batch: int, s_local: int) -> tuple[int, int, int, int]:
        """The saved log-sum-exp of a call: per stage, this rank's query heads over the full
        sequence (``[stages, B, m, S]``, float32), as the forward loops and fake kernels make it."""
        return (len(self.stages), batch, self.q_per_rank, s_local * self.world)

    @property
    def stages_per_group(self) -> int:
        return len(self.stages) // len(self.kv_groups)

    @property
    def stage_uses_whole_group(self) -> bool:
        """One stage per KV group, reading all of its ``k`` KV slots in the plain layout
        (MHA, Ulysses): that stage's dK/dV are the group's, no accumulation needed."""
        return self.stages_per_group == 1 and all(s.kv_slot_range == (0, self.kv_per_rank) for s in self.stages)


@functools.lru_cache(maxsize=256)
def plan_stages(q_heads: int, kv_heads: int, world: int, heads_per_stage: int) -> StageSchedule:
    if world < 1:
        raise ScheduleError(f"context-parallel size must be >= 1, got {world}")
    if heads_per_stage < 1 or heads_per_stage % world:
        raise ScheduleError(
            f"heads_per_stage={heads_per_stage} must be a positive multiple of the context-parallel size P={world}"
        )
    if q_heads % heads_per_stage:
        raise ScheduleError(
            f"{q_heads} query heads cannot be split into stages of heads_per_stage={heads_per_stage}; "
            f"pick a multiple of P={world} that divides {q_heads}"
        )
    if kv_heads < 1 or q_heads % kv_heads:
        raise ScheduleError(f"{q_heads} query heads is not a multiple of {kv_heads} KV heads")
    kv_eff = math.lcm(kv_heads, world)
    if q_heads % kv_eff:
        raise ScheduleError(
            f"{kv_heads} KV heads cannot be spread over P={world} ranks for {q_heads} query heads: "
            f"replicating KV heads to lcm({kv_heads}, {world})={kv_eff} needs {kv_eff} to divide {q_heads}"
        )
    replicas = kv_eff // kv_heads
    group_size = q_heads // kv_eff
    m = heads_per_stage // world
    k = next(k for k in range(1, kv_eff // world + 1) if (kv_eff // world) % k == 0 and (group_size * k) % m == 0)

    kv_groups, stages = [], []
    for group in range(kv_eff // (world * k)):
        replica_of = [[group * world * k + r * k + j for j in range(k)] for r in range(world)]
        kv_groups.append(tuple(rep // replicas for rank in replica_of for rep in rank))
        q_of_rank = [[rep * group_size + i for rep in rank for i in range(group_size)] for rank in replica_of]
        for t in range(group_size * k // m):
            stages.append(
                Stage(
                    q_heads=tuple(h for rank in q_of_rank for h in rank[t * m:(t + 1) * m]),
                    kv_group=group,
                    kv_slots=tuple((t * m + i) // group_size for i in range(m)),
                )
            )
    return StageSchedule(
        world=world, q_heads=q_heads, kv_heads=kv_heads, heads_per_stage=heads_per_stage,
        q_per_rank=m, kv_per_rank=k, kv_groups=tuple(kv_groups), stages=tuple(stages),
    )


def shape_problems(q_shape, k_shape, v_shape, enable_gqa: bool, world: int, heads_per_stage: int) -> list[str]:
    """Why q/k/v of these shapes cannot run as UPipe on ``world`` ranks (empty: they can).
    Shared by the compile-time validation and the public op."""
    q_shape, k_shape, v_shape = tuple(q_shape), tuple(k_shape), tuple(v_shape)
    if len(q_shape) != 4 or len(k_shape) != 4 or len(v_shape) != 4:
        return [f"q/k/v must be 4-D [batch, heads, seq, head_dim]; got {q_shape}, {k_shape}, {v_shape}"]
    # v's head dim may differ from q's and k's (MLA): the entry points pad to one
    if k_shape[:3] != v_shape[:3] or q_shape[2] != k_shape[2] or (q_shape[0], q_shape[3]) != (k_shape[0], k_shape[3]):
        return [
            f"UPipe runs self-attention over one sharded sequence; q {q_shape}, k {k_shape}, v {v_shape} "
            "do not share batch, sequence length and (q, k) head_dim"
        ]
    problems = []
    q_heads, kv_heads = int(q_shape[1]), int(k_shape[1])
    # one KV head broadcasts over every query head (Falcon's multi-query SDPA call): that is GQA
    if q_heads != kv_heads and kv_heads != 1 and not enable_gqa:
        problems.append(f"{q_heads} query heads but {kv_heads} KV heads without enable_gqa=True: pass enable_gqa=True (as for SDPA)")
    try:
        plan_stages(q_heads, kv_heads, world, heads_per_stage)
    except ScheduleError as error:
        problems.append(f"{error} (P={world}, heads_per_stage={heads_per_stage})")
    return problems
