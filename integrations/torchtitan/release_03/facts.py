"""The facts of a torchtitan 0.3 job that the rules of job_rules.py ask, read from its
``Trainer.Config`` alone (before any process group), and the release's names for what the
rules and the parallelize function look up (AC kinds, attention configs, the stock
parallelize functions).
"""

from __future__ import annotations

from torchtitan.components.loss import ChunkedLossWrapper
from torchtitan.distributed.activation_checkpoint import FullAC, MemoryBudgetAC, SelectiveAC
from torchtitan.models.common.attention import BaseAttention, FlexAttention, VarlenAttention

from upipe_compile.integrations.torchtitan.job_rules import MODELS, JobFacts, Spelling

NAME = "0.3"

SPELLING = Spelling(
    toml=False, full_ac="activation_checkpoint = FullAC.Config()",
    attention_fix=('use varlen attention: model_registry(flavor, attn_backend="varlen") (upipe rewrites '
                   "varlen_attn over the documents of the whole sequence; Flex masks it cannot read)"),
)


def ac_kind(config) -> str:
    """The AC config's class as job_rules names it (0.3's SelectiveAC saves ops: "selective_op")."""
    ac = config.activation_checkpoint
    if ac is None:
        return "none"
    for cls, kind in ((FullAC, "full"), (SelectiveAC, "selective_op"), (MemoryBudgetAC, "memory_budget")):
        if isinstance(ac, cls.Config):
            return kind
    return type(ac).__qualname__


def attention_configs(config):
    """Every attention config of the job's model: (fqn, config)."""
    return [(fqn, cfg) for fqn, cfg, _, _ in config.model_spec.model.traverse(BaseAttention.Config)]


def stock_parallelize(model_name: str):
    """torchtitan 0.3's own parallelize function for ``model_name`` (None: not one upipe knows)."""
    if model_name == "llama3":
        from torchtitan.models.llama3.parallelize import parallelize_llama

        return parallelize_llama
    if model_name == "qwen3":
        from torchtitan.models.qwen3.parallelize import parallelize_qwen3

        return parallelize_qwen3
    return None


def job_facts(config) -> JobFacts:
    """The facts of a 0.3 job, from its config."""
    p, training, ac = config.parallelism, config.training, config.activation_checkpoint
    loss_name = None if isinstance(config.loss, ChunkedLossWrapper.Config) else type(config.loss).__qualname__
    return JobFacts(
        spelling=SPELLING, upipe=config.upipe, cp=p.context_parallel_degree, seq_len=training.seq_len,
        local_batch_size=training.local_batch_size, compile_components=tuple(config.compile.components),
        other_degrees={"pipeline_parallel_degree": p.pipeline_parallel_degree},
        tp=p.tensor_parallel_degree, ep=p.expert_parallel_degree, attention_alone=True,
        fsdp_cpu_offload=bool(training.enable_cpu_offload), ac=ac_kind(config), ac_name=type(ac).__qualname__,
        spmd_backend=p.spmd_backend,
        load_balancer=p.context_parallel_load_balancer, validator=bool(config.validator.enable),
        loss_name=loss_name, **_model_facts(config),
    )


def _model_facts(config) -> dict:
    """The model's facts (only its name where it is not one upipe knows: nothing else is read)."""
    spec = config.model_spec
    if spec is None:
        return {"model_name": ""}
    if spec.name not in MODELS:
        return {"model_name": spec.name}
    foreign = None
    if spec.parallelize_fn is not stock_parallelize(spec.name):
        foreign = getattr(spec.parallelize_fn, "__qualname__", repr(spec.parallelize_fn))
    attention, heads = "sdpa", []
    for _, cfg in attention_configs(config):
        inner = getattr(cfg, "inner_attention", None)
        if isinstance(inner, FlexAttention.Config):
            attention = "flex"
        elif isinstance(inner, VarlenAttention.Config) and attention != "flex":
            attention = "varlen"
        n_heads = getattr(cfg, "n_heads", None)
        if n_heads is not None and n_heads not in heads:
            heads.append(n_heads)
    return {"model_name": spec.name, "foreign_parallelize": foreign, "attention": attention, "n_heads": tuple(heads),
            "moe": any(getattr(layer, "moe", None) is not None for layer in spec.model.layers)}
