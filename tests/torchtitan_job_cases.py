"""Bad torchtitan jobs and the reason upipe refuses each, one table for both releases:
tests/test_torchtitan_job_rules.py asks torchtitan 0.2.2's check (a TOML job), and
tests/torchtitan03/test_torchtitan03_job_rules.py 0.3's (a Python config). Each case is the
same job on either release (the debug model at P = 2 unless its overrides say otherwise)
and one reason, spelled by the release's job_rules.Spelling: ``[upipe] ring_degree = 3`` in
a TOML, ``upipe.ring_degree = 3`` in a Python config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class BadJob:
    name: str
    reason: Callable
    """Spelling -> the refusal's text (or its start, where it goes on with values of the job)."""
    overrides: tuple[str, ...] = ()
    """Command-line overrides both releases' ConfigManager take."""
    upipe: dict = field(default_factory=dict)
    """Values set on the job's upipe section after loading (what no command line can spell)."""
    selective_ac: bool = False
    """Selective (op) activation checkpointing, as each release asks for it."""
    varlen: bool = False
    """The model's attention is varlen (0.3's debug config has it already)."""
    releases: tuple[str, ...] = ("0.2.2", "0.3")
    """The releases that refuse the job for this reason (0.3 runs TP beside upipe's CP)."""


def cases_of(release: str) -> list[BadJob]:
    return [case for case in BAD_JOBS if release in case.releases]


BAD_JOBS = [
    # the stack's checks, which 0.3 did not ask before the rules were shared
    BadJob("negative-host-reserve", upipe={"host_memory_reserve_gib": -2.0},
           reason=lambda s: f"{s.key('upipe.host_memory_reserve_gib')} = -2.0 must be a number >= 0 (or -1: scaled "
                            "to the node)"),
    BadJob("offload-not-a-bool", upipe={"offload_block_inputs": "yes"},
           reason=lambda s: f"{s.key('upipe.offload_block_inputs')} = 'yes' must be {s.value(True)} or "
                            f"{s.value(False)}"),
    BadJob("keep-attention-not-a-bool", upipe={"keep_attention": 1},
           reason=lambda s: f"{s.key('upipe.keep_attention')} = 1 must be {s.value(True)} or {s.value(False)}"),
    BadJob("negative-mlp-tiles", upipe={"mlp_tile_tokens": -4},
           reason=lambda s: f"{s.key('upipe.mlp_tile_tokens')} = -4 must be a whole number of tokens > 0 (or 0 = off)"),
    BadJob("offload-without-full-ac", upipe={"offload_block_inputs": True}, selective_ac=True,
           reason=lambda s: f"{s.key('upipe.offload_block_inputs')} = {s.value(True)} needs {s.full_ac} (got "),
    BadJob("kept-blocks-without-offload", upipe={"blocks_kept_on_device": 2},
           reason=lambda s: f"{s.key('upipe.blocks_kept_on_device')} = 2 keeps some blocks' inputs off the host, but "
                            f"{s.key('upipe.offload_block_inputs')} is {s.value(False)}: nothing is offloaded"),
    BadJob("kept-blocks-negative", upipe={"offload_block_inputs": True, "blocks_kept_on_device": -1},
           reason=lambda s: f"{s.key('upipe.blocks_kept_on_device')} = -1 must be a whole number of blocks >= 0"),
    BadJob("keep-and-recompute", upipe={"keep_attention": True, "recompute_attention_output": True},
           reason=lambda s: f"{s.key('upipe.keep_attention')} = {s.value(True)} and recompute_attention_output = "
                            f"{s.value(True)} ask for opposite things"),
    # the layout
    BadJob("seq-len", overrides=("--training.seq_len=1001",),
           reason=lambda s: f"{s.key('training.seq_len')} = 1001 must be divisible by the CP degree 2 "
                            f"({s.key('parallelism.context_parallel_degree')})"),
    BadJob("ring-degree", overrides=("--parallelism.context_parallel_degree=4", "--upipe.ring_degree=3"),
           reason=lambda s: f"{s.key('upipe.ring_degree')} = 3 must divide "
                            f"{s.key('parallelism.context_parallel_degree')} = 4"),
    BadJob("tensor-parallel", overrides=("--parallelism.tensor_parallel_degree=2",), releases=("0.2.2",),
           reason=lambda s: f"{s.key('parallelism.tensor_parallel_degree')} = 2: upipe's context parallelism does "
                            "not run beside tensor parallelism in a torchtitan 0.2.2 job (its blocks would hold "
                            "DTensor shards of the heads; a 0.3 job runs it); the same 4 GPUs run under upipe as "
                            f"{s.key('parallelism.tensor_parallel_degree')} = 1 and "
                            f"{s.key('parallelism.context_parallel_degree')} = 4"),
    BadJob("tensor-parallel-beyond-the-heads", overrides=("--parallelism.tensor_parallel_degree=16",),
           releases=("0.2.2",),
           reason=lambda s: f"{s.key('parallelism.tensor_parallel_degree')} = 16: upipe's context parallelism does "
                            "not run beside tensor parallelism in a torchtitan 0.2.2 job (its blocks would hold "
                            "DTensor shards of the heads; a 0.3 job runs it); the same 32 GPUs run under upipe as "
                            f"{s.key('parallelism.tensor_parallel_degree')} = 1 and "
                            f"{s.key('parallelism.context_parallel_degree')} = 32 with "
                            f"{s.key('upipe.ring_degree')} = 2 (16 all-to-all ranks per ring step)"),
    BadJob("tensor-parallel-fused", overrides=("--parallelism.tensor_parallel_degree=2",), releases=("0.3",),
           reason=lambda s: f"{s.key('parallelism.tensor_parallel_degree')} = 2: the q/k/v/o projections are "
                            "TP-sharded, so upipe cannot fuse the projections into its stage loop; set "
                            f"{s.key('upipe.fuse_projections')} = {s.value(False)}"),
    BadJob("tensor-parallel-beyond-the-heads-per-cp", overrides=(
        "--parallelism.tensor_parallel_degree=16", "--upipe.no_fuse_projections"), releases=("0.3",),
           reason=lambda s: f"the heads per TP rank, 1 (n_heads = 16 / {s.key('parallelism.tensor_parallel_degree')} "
                            "16), is not divisible by the CP degree 2"),
    BadJob("pipeline-parallel", overrides=("--parallelism.pipeline_parallel_degree=2",),
           reason=lambda s: f"{s.key('parallelism.pipeline_parallel_degree')} = 2: upipe's context parallelism does "
                            "not run beside pipeline parallelism"),
    BadJob("heads-per-stage", upipe={"heads_per_stage": 3},
           reason=lambda s: f"{s.key('upipe.heads_per_stage')}=3 must be a positive multiple of the context-parallel "
                            "size P=2"),
    # the model
    BadJob("heads", overrides=("--parallelism.context_parallel_degree=32", "--training.seq_len=2048"),
           reason=lambda s: f"n_heads = 16 is not divisible by the CP degree 32: set {s.key('upipe.ring_degree')}"),
    BadJob("varlen-rows", overrides=("--training.local_batch_size=2",), varlen=True,
           reason=lambda s: f"{s.key('training.local_batch_size')} = 2: varlen attention needs 1"),
]
