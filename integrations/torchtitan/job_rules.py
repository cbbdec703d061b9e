"""What a torchtitan job must be for UPipe context parallelism: one set of facts about the job
and one ordered list of rules over them, asked by both torchtitan releases.

Each release reads its own config into :class:`JobFacts` once (release_022/facts.py from the 0.2.2
TOML's JobConfig, release_03/facts.py from 0.3's ``Trainer.Config``); the rules never see a
config. A rule returns its refusals (empty: the job is fine), each naming the setting to
change in the job's own spelling (:class:`Spelling`: ``[training] seq_len`` in a TOML,
``training.seq_len`` in a Python config). A fact a release does not have is None (or False)
there, and the rules about it stay silent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from upipe_compile.errors import UnsupportedAttention
from upipe_compile.integrations.torchtitan.config import DEFAULT_HOST_RESERVE, UPipe
from upipe_compile.options import option_problems
from upipe_compile.sharding import sequence_multiple

MODELS = ("llama3", "qwen3")
"""The models whose parallelize upipe's replaces (dense flavors; MoE ones where the release
compiles the attention alone, :attr:`JobFacts.attention_alone`)."""


@dataclass(frozen=True)
class Spelling:
    """How a release's job names its settings, so a refusal names the one to change."""

    toml: bool
    """True: 0.2.2's TOML sections (``[upipe] ring_degree = 2``, ``true``); False: 0.3's
    dotted Python fields (``upipe.ring_degree = 2``, ``True``)."""
    full_ac: str
    """Full activation checkpointing, as the job asks for it."""
    attention_fix: str
    """How to give the model attention upipe rewrites."""

    def key(self, path: str) -> str:
        section, _, name = path.partition(".")
        return f"[{section}] {name}" if self.toml else path

    def value(self, value) -> str:
        if isinstance(value, bool):
            return str(value).lower() if self.toml else str(value)
        return repr(value)


@dataclass(frozen=True)
class JobFacts:
    """What the rules read of one job, read once from its config and model (whatever the release)."""

    spelling: Spelling
    upipe: UPipe
    cp: int
    seq_len: int
    local_batch_size: int
    compile_components: tuple[str, ...]
    other_degrees: dict[str, int]
    """``parallelism.<name>_degree`` of the parallelisms upipe does not run beside its CP
    (pipeline; tensor and expert in a release without :attr:`tp` and :attr:`ep`), by field name."""
    ac: str
    """Activation checkpointing: "full", "selective", "selective_op" (selective, saving ops),
    "memory_budget" or "none"."""
    ac_name: str
    """``ac`` as the job spells it (0.2.2: the mode; 0.3: the config class)."""
    tp: int = 1
    """``parallelism.tensor_parallel_degree`` where the release runs TP beside upipe's CP (0.3:
    the heads split over the TP group first, upipe's stage loop over the CP group on each TP
    rank's heads); a release that does not lists it in :attr:`other_degrees`."""
    ep: int = 1
    """``parallelism.expert_parallel_degree`` where the release runs EP beside upipe's CP
    (0.3; a release that does not lists it in :attr:`other_degrees`)."""
    attention_alone: bool = False
    """The release can compile each layer's attention alone with upipe and leave the rest of
    the block to its own modules and parallelisms (0.3: TP, MoE layers, EP)."""
    fsdp_cpu_offload: bool = False
    """``training.enable_cpu_offload``: FSDP keeps the sharded parameters, gradients and
    optimizer state on the host, and the optimizer steps there."""
    # 0.3's own settings: None / False in 0.2.2, which has none of them (or upipe sets them)
    spmd_backend: str | None = None
    load_balancer: str | None = None
    validator: bool = False
    loss_name: str | None = None
    """The loss config's class when it is not the chunked loss ``loss_chunk_tokens`` sizes."""
    # the model: None where not known (not given yet, or a model the rules cannot read)
    model_name: str | None = None
    """The model upipe parallelizes ("" : the job names none)."""
    foreign_parallelize: str | None = None
    """A parallelize function the job puts in place of the model's own (0.3's ModelSpec)."""
    moe: bool | None = None
    attention: str | None = None
    """The attention the model runs: "sdpa", "varlen", "flex", or another name."""
    n_heads: tuple[int, ...] | None = None
    """Query heads of the attention layers (each distinct count once)."""

    @property
    def all_to_all_degree(self) -> int:
        return self.upipe.all_to_all_degree(self.cp)


Rule = Callable[[JobFacts], list]


# --- the [upipe] stack keys ------------------------------------------------------------------

def _token_counts(f: JobFacts) -> list[str]:
    problems = []
    for name in ("mlp_tile_tokens", "loss_chunk_tokens"):
        value = getattr(f.upipe, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            problems.append(f"{f.spelling.key('upipe.' + name)} = {value!r} must be a whole number of tokens > 0 "
                            "(or 0 = off)")
    return problems


def _offload_block_inputs(f: JobFacts) -> list[str]:
    s, offload = f.spelling, f.upipe.offload_block_inputs
    if not isinstance(offload, bool):
        return [f"{s.key('upipe.offload_block_inputs')} = {offload!r} must be {s.value(True)} or {s.value(False)}"]
    if offload and f.ac != "full":
        return [f"{s.key('upipe.offload_block_inputs')} = {s.value(True)} needs {s.full_ac} (got {f.ac_name}): "
                "only then is the block input all a block saves"]
    kept = f.upipe.blocks_kept_on_device
    if isinstance(kept, bool) or not isinstance(kept, int) or kept < 0:
        return [f"{s.key('upipe.blocks_kept_on_device')} = {kept!r} must be a whole number of blocks >= 0"]
    if kept and not offload:
        return [f"{s.key('upipe.blocks_kept_on_device')} = {kept} keeps some blocks' inputs off the host, but "
                f"{s.key('upipe.offload_block_inputs')} is {s.value(False)}: nothing is offloaded (set it to "
                f"{s.value(True)}, or this to 0)"]
    return []


def _keep_attention(f: JobFacts) -> list[str]:
    s, keep = f.spelling, f.upipe.keep_attention
    if not isinstance(keep, bool):
        return [f"{s.key('upipe.keep_attention')} = {keep!r} must be {s.value(True)} or {s.value(False)}"]
    if not keep:
        return []
    problems = []
    if f.ac != "full":
        problems.append(f"{s.key('upipe.keep_attention')} = {s.value(True)} needs {s.full_ac} (got {f.ac_name}): "
                        "without a recompute there is no second attention forward to save (selective op AC "
                        "keeps upipe's attention ops already)")
    if f.upipe.recompute_attention_output:
        problems.append(f"{s.key('upipe.keep_attention')} = {s.value(True)} and recompute_attention_output = "
                        f"{s.value(True)} ask for opposite things (keep the attention output / run attention "
                        "again in backward): set one")
    return problems


def _host_memory_reserve(f: JobFacts) -> list[str]:
    reserve = f.upipe.host_memory_reserve_gib
    if isinstance(reserve, bool) or not isinstance(reserve, (int, float)) or (reserve < 0
                                                                               and reserve != DEFAULT_HOST_RESERVE):
        return [f"{f.spelling.key('upipe.host_memory_reserve_gib')} = {reserve!r} must be a number >= 0 "
                f"(or {DEFAULT_HOST_RESERVE:g}: scaled to the node)"]
    return []


def _chunked_loss(f: JobFacts) -> list[str]:
    if f.upipe.loss_chunk_tokens and f.loss_name is not None:
        return [f"{f.spelling.key('upipe.loss_chunk_tokens')} = {f.upipe.loss_chunk_tokens!r} sizes the chunks of "
                f"torchtitan's own chunked loss, but loss is {f.loss_name}: set "
                "loss=ChunkedLossWrapper.Config(loss_fn=...)"]
    return []


STACK_RULES: tuple[Rule, ...] = (_token_counts, _offload_block_inputs, _keep_attention, _host_memory_reserve,
                                 _chunked_loss)
"""What the stack keys get wrong, before any model exists (0.2.2's loss builder asks these alone)."""


# --- the layout: CP degree, ring, the options ------------------------------------------------

def _ring(f: JobFacts) -> list[str]:
    s, ring, cp = f.spelling, f.upipe.ring_degree, f.cp
    if ring < 1:
        return [f"{s.key('upipe.ring_degree')} = {ring} must be >= 1 (1 = no ring)"]
    if ring == 1:
        return []
    if cp % ring:
        return [f"{s.key('upipe.ring_degree')} = {ring} must divide {s.key('parallelism.context_parallel_degree')} = "
                f"{cp} (the CP ranks split into ring_degree groups of equal size)"]
    pieces = sequence_multiple(cp, ring)
    if f.seq_len % pieces:
        return [f"{s.key('training.seq_len')} = {f.seq_len} must be divisible by 2 x context_parallel_degree = "
                f"{pieces} with {s.key('upipe.ring_degree')} = {ring} (two zigzag chunks per ring rank, split over "
                "its all-to-all ranks)"]
    return []


def _options(f: JobFacts) -> list[str]:
    """The options' own check (UPipeOptions'), named by their upipe keys."""
    cfg = f.upipe
    return [f.spelling.key(f"upipe.{p}") for p in option_problems(
        world=f.all_to_all_degree, heads_per_stage=cfg.heads_per_stage_option, prefetch=cfg.prefetch,
        inner_backend=cfg.inner_backend, fuse_projections=cfg.fuse_projections,
        recompute_attention_output=cfg.recompute_attention_output)]


def _compiles_the_model(f: JobFacts) -> list[str]:
    if "model" not in f.compile_components:
        return [f'{f.spelling.key("compile.components")} must contain "model" (the blocks are what upipe rewrites)']
    return []


_WHY_NOT = {
    "tensor_parallel_degree": "upipe's context parallelism does not run beside tensor parallelism in a "
                              "torchtitan 0.2.2 job (its blocks would hold DTensor shards of the heads; a 0.3 "
                              "job runs it)",
    "pipeline_parallel_degree": "upipe's context parallelism does not run beside pipeline parallelism (each "
                                "stage would compile part of the blocks with its own CP group)",
    "expert_parallel_degree": "upipe's context parallelism does not run beside expert parallelism yet (the "
                              "experts' token all-to-all would sit inside the compiled blocks)",
}


def _other_parallelisms(f: JobFacts) -> list[str]:
    """Refused with the numbers of a layout that runs on the same GPUs: the other degree folded
    into the CP degree (FSDP then shards the weights, experts included, over all of them)."""
    s, others = f.spelling, {name: degree for name, degree in f.other_degrees.items() if degree > 1}
    if not others:
        return []
    folded = f.cp
    for degree in others.values():
        folded *= degree
    ones = ", ".join(f"{s.key('parallelism.' + name)} = 1" for name in others)
    layout = f"{ones} and {s.key('parallelism.context_parallel_degree')} = {folded}" + _ring_hint(f, folded)
    if f.tp > 1:  # TP stays: the heads per TP rank are what the all-to-all splits
        layout += f", beside {s.key('parallelism.tensor_parallel_degree')} = {f.tp}"
    return [f"{s.key('parallelism.' + name)} = {degree}: {_WHY_NOT.get(name, 'not supported with upipe')}; "
            f"the same {folded * f.tp} GPUs run under upipe as {layout}" for name, degree in others.items()]


def _ring_hint(f: JobFacts, cp: int, tp: int | None = None) -> str:
    """" with ring_degree = R (...)" when ``cp`` CP ranks need a ring for the heads per TP rank."""
    tp = f.tp if tp is None else tp
    ring = _ring_for(cp, [heads // tp for heads in f.n_heads] if f.n_heads else None)
    if ring is None or ring == 1:
        return ""
    return f" with {f.spelling.key('upipe.ring_degree')} = {ring} ({cp // ring} all-to-all ranks per ring step)"


def _ring_for(cp: int, n_heads) -> int | None:
    """The smallest ring degree R dividing ``cp`` whose all-to-all degree cp / R divides every
    head count (None: the head counts are not known)."""
    if not n_heads:
        return None
    return next(r for r in range(1, cp + 1) if cp % r == 0 and all(h % (cp // r) == 0 for h in n_heads))


def _seq_len(f: JobFacts) -> list[str]:
    if f.seq_len % f.cp:
        return [f"{f.spelling.key('training.seq_len')} = {f.seq_len} must be divisible by the CP degree {f.cp} "
                f"({f.spelling.key('parallelism.context_parallel_degree')})"]
    return []


def _spmd_backend(f: JobFacts) -> list[str]:
    if f.spmd_backend is not None and f.spmd_backend != SPMD_BACKEND:
        return [f"{f.spelling.key('parallelism.spmd_backend')} = {f.spmd_backend!r}: upipe's context parallelism "
                f"runs on the {SPMD_BACKEND!r} backend (plain tensors inside the blocks); set it"]
    return []


SPMD_BACKEND = "partial_dtensor"
"""0.3's DTensor-FSDP path, the one whose parallelize applies CP as a separate step (the one
upipe replaces); "spmd_types" and "full_dtensor" annotate every tensor with its CP sharding."""


def _load_balancer(f: JobFacts) -> list[str]:
    if f.cp > 1 and f.load_balancer is not None:
        return [f"{f.spelling.key('parallelism.context_parallel_load_balancer')} = {f.load_balancer!r}: torchtitan's "
                "load balancer reorders the sequence for its own CP; upipe lays it out itself (contiguous shards, "
                "zigzag over the ring with upipe.ring_degree): set it to None"]
    return []


def _validator(f: JobFacts) -> list[str]:
    if f.cp > 1 and f.validator:
        return [f"{f.spelling.key('validator.enable')} = {f.spelling.value(True)}: torchtitan's validator shards its "
                "batches for torchtitan's own context parallelism, not upipe's; set it to "
                f"{f.spelling.value(False)}"]
    return []


def _memory_budget_ac(f: JobFacts) -> list[str]:
    if f.ac == "memory_budget":
        return [f"activation_checkpoint = {f.ac_name}: not supported with upipe (its budget is solved by "
                "inductor's partitioner, which upipe's ops sit outside); use FullAC or SelectiveAC"]
    return []


_WHOLE_BLOCK_KEYS = ("keep_attention", "offload_block_inputs", "mlp_tile_tokens")
"""Stack keys that act on whole compiled blocks or on plain (not TP-sharded) activations: none
runs beside TP; beside MoE layers alone only keep_attention does not (it keeps the fused
block's outputs, and a MoE block is not fused)."""
_BESIDE_MOE_KEYS = ("offload_block_inputs", "mlp_tile_tokens")


def _attention_alone(f: JobFacts) -> list[str]:
    """TP (the projections are TP-sharded DTensors) and MoE layers (the experts' token dispatch,
    an all-to-all of its own with EP) stay outside upipe's graph: upipe compiles each layer's
    attention alone, as the plain stage-loop op on the rank's heads (no fused block), and the
    stack keys that act on whole blocks or plain activations stay off (beside MoE layers alone,
    offload and tiling run: _BESIDE_MOE_KEYS)."""
    s = f.spelling
    if f.tp < 1:
        return [f"{s.key('parallelism.tensor_parallel_degree')} = {f.tp} must be >= 1"]
    outside = []
    if f.tp > 1:
        outside.append((f"{s.key('parallelism.tensor_parallel_degree')} = {f.tp}",
                        "the q/k/v/o projections are TP-sharded"))
    if f.moe and f.attention_alone:
        outside.append(("the model's MoE layers", "their token dispatch is torchtitan's own, outside upipe's graph"))
    if not outside:
        return []
    what = " and ".join(name for name, _ in outside)
    why = "; ".join(reason for _, reason in outside)
    problems = []
    if f.upipe.fuse_projections:
        problems.append(f"{what}: {why}, so upipe cannot fuse the projections into its stage loop; set "
                        f"{s.key('upipe.fuse_projections')} = {s.value(False)} (upipe then runs its stage-loop "
                        "attention on each rank's heads)")
    fold = (f", or set {s.key('parallelism.tensor_parallel_degree')} = 1 and fold the TP ranks into "
            f"{s.key('parallelism.context_parallel_degree')} = {f.cp * f.tp}{_ring_hint(f, f.cp * f.tp, 1)}"
            if f.tp > 1 else "")
    for name in _WHOLE_BLOCK_KEYS:
        if getattr(f.upipe, name) and (f.tp > 1 or name not in _BESIDE_MOE_KEYS):
            # folding TP into CP brings back what a model's MoE layers allow
            unfold = fold if not f.moe or name in _BESIDE_MOE_KEYS else ""
            problems.append(f"{what}: {s.key('upipe.' + name)} is not supported where upipe compiles the attention "
                            f"alone; turn it off{unfold}")
    if f.tp > 1 and f.seq_len % (f.cp * f.tp):
        problems.append(f"{s.key('training.seq_len')} = {f.seq_len} must be divisible by CP x TP = {f.cp * f.tp} "
                        "(each CP shard is split over the TP ranks)")
    return problems


def _expert_parallel_needs_experts(f: JobFacts) -> list[str]:
    if f.ep > 1 and f.moe is False:
        return [f"{f.spelling.key('parallelism.expert_parallel_degree')} = {f.ep}, but the model has no MoE layers: "
                "set it to 1"]
    return []


LAYOUT_RULES: tuple[Rule, ...] = (_ring, _options, _compiles_the_model, _attention_alone,
                                  _expert_parallel_needs_experts, _other_parallelisms, _seq_len, _spmd_backend,
                                  _load_balancer, _validator, _memory_budget_ac)


# --- the model -------------------------------------------------------------------------------

def _known_model(f: JobFacts) -> list[str]:
    if f.model_name is None or f.model_name in MODELS:
        return []
    if not f.model_name:
        return ["model_spec is not set: upipe parallelizes the model the config names"]
    hybrid = (" Its linear-attention layers (Gated DeltaNet, fla's kernels) mix tokens along the sequence "
              "and have no context-parallel form here: they would run on each rank's shard alone. Qwen3.5 "
              "runs exactly through upipe's transformers integration (upipe_compile.integrations."
              "transformers.register()), its mixers as stage loops." if f.model_name == "qwen3_5" else "")
    return [f"{f.spelling.key('model_spec.name')} = {f.model_name!r}: upipe runs {' and '.join(MODELS)} "
            f"(dense; MoE flavors on torchtitan 0.3).{hybrid}"]


def _own_parallelize(f: JobFacts) -> list[str]:
    if f.foreign_parallelize is not None:
        return [f"model_spec.parallelize_fn is {f.foreign_parallelize}, not torchtitan's parallelize for "
                f"{f.model_name!r}: upipe replaces that one (without its apply_cp_to_forward) and cannot tell "
                "what another does"]
    return []


def _dense(f: JobFacts) -> list[str]:
    if f.moe and not f.attention_alone:
        return ["the model flavor has MoE layers: not supported with backend upipe (not implemented); "
                "use a dense flavor"]
    return []


def _attention_kind(f: JobFacts) -> list[str]:
    if f.attention is not None and f.attention not in ("sdpa", "varlen"):
        return [f'the model\'s attention is "{f.attention}"; backend upipe needs "sdpa" or "varlen": '
                f"{f.spelling.attention_fix}"]
    return []


def _one_packed_row(f: JobFacts) -> list[str]:
    if f.attention == "varlen" and f.local_batch_size != 1:
        return [f"{f.spelling.key('training.local_batch_size')} = {f.local_batch_size}: varlen attention needs 1 "
                "(one packed row of documents per rank; varlen_attn flattens the batch into one row)"]
    return []


def _heads_split(f: JobFacts) -> list[str]:
    s, a2a, ring = f.spelling, f.all_to_all_degree, f.upipe.ring_degree
    for heads in f.n_heads or ():
        if heads % f.tp:
            return [f"n_heads = {heads} is not divisible by {s.key('parallelism.tensor_parallel_degree')} = {f.tp} "
                    "(each TP rank holds whole heads)"]
        local, of = heads // f.tp, (f"the heads per TP rank, {heads // f.tp} (n_heads = {heads} / "
                                    f"{s.key('parallelism.tensor_parallel_degree')} {f.tp})," if f.tp > 1
                                    else f"n_heads = {heads}")
        if local % a2a:
            if ring > 1:
                return [f"{of} is not divisible by the all-to-all degree {a2a} (the CP degree {f.cp} / "
                        f"{s.key('upipe.ring_degree')} {ring}): raise ring_degree"]
            return [f"{of} is not divisible by the CP degree {f.cp}: set {s.key('upipe.ring_degree')} "
                    "so that CP / ring_degree divides it (ring attention across the groups)"
                    + (", or lower the TP degree" if f.tp > 1 else "")]
    return []


def _heads_per_stage_divides(f: JobFacts) -> list[str]:
    per_stage = f.upipe.heads_per_stage
    for heads in f.n_heads or ():
        local = heads // f.tp
        if per_stage and isinstance(per_stage, int) and local % per_stage:
            of = f"the {local} heads per TP rank" if f.tp > 1 else f"n_heads = {heads}"
            return [f"{f.spelling.key('upipe.heads_per_stage')} = {per_stage} must divide {of}"]
    return []


MODEL_RULES: tuple[Rule, ...] = (_known_model, _own_parallelize, _dense, _attention_kind, _one_packed_row,
                                 _heads_split, _heads_per_stage_divides)

JOB_RULES: tuple[Rule, ...] = STACK_RULES + LAYOUT_RULES + MODEL_RULES
"""Every rule, in the order the refusal lists them."""


def job_problems(facts: JobFacts, rules: tuple[Rule, ...] = JOB_RULES) -> list[str]:
    """Everything the job gets wrong (empty: nothing), each naming the setting to change."""
    return [problem for rule in rules for problem in rule(facts)]


def refuse(problems: list[str], spelling: Spelling) -> None:
    """Raise UnsupportedAttention listing ``problems`` (nothing when there are none)."""
    if problems:
        raise UnsupportedAttention(f'torchtitan job cannot run with {spelling.key("compile.backend")} = "upipe":\n'
                                   + "".join(f"  - {p}\n" for p in problems))
