"""The facts of a torchtitan 0.2.2 job that the rules of job_rules.py ask, read from its
JobConfig (the TOML with the [upipe] section of config.py) and, once built, its TrainSpec's
``model_args``.
"""

from __future__ import annotations

from upipe_compile.integrations.torchtitan.config import upipe_config
from upipe_compile.integrations.torchtitan.job_rules import JobFacts, Spelling

NAME = "0.2.2"

SPELLING = Spelling(
    toml=True, full_ac='[activation_checkpoint] mode = "full"',
    attention_fix='use a flavor whose attn_type is "sdpa" or "varlen" (e.g. "8B" or "8B_varlen", not "8B_flex")',
)


def ac_kind(job_config) -> str:
    """[activation_checkpoint] as job_rules names it (selective op AC saves ops: "selective_op")."""
    ac = job_config.activation_checkpoint
    if ac.mode == "selective" and ac.selective_ac_option == "op":
        return "selective_op"
    return ac.mode


def job_facts(job_config, parallel_dims=None, model_args=None) -> JobFacts:
    """The facts of a 0.2.2 job: the degrees of ``parallel_dims`` where given (else the TOML's),
    the model's where ``model_args`` is given."""
    p, training = job_config.parallelism, job_config.training
    dims = parallel_dims
    degrees = ({"tensor_parallel_degree": dims.tp, "pipeline_parallel_degree": dims.pp,
                "expert_parallel_degree": dims.ep} if dims is not None else
               {name: getattr(p, name) for name in
                ("tensor_parallel_degree", "pipeline_parallel_degree", "expert_parallel_degree")})
    model = {}
    if model_args is not None:
        model = {"model_name": job_config.model.name, "moe": bool(getattr(model_args, "moe_enabled", False)),
                 "attention": getattr(model_args, "attn_type", "sdpa"), "n_heads": (model_args.n_heads,)}
    return JobFacts(
        spelling=SPELLING, upipe=upipe_config(job_config),
        cp=dims.cp if dims is not None else p.context_parallel_degree,
        seq_len=training.seq_len, local_batch_size=training.local_batch_size,
        compile_components=tuple(job_config.compile.components), other_degrees=degrees,
        fsdp_cpu_offload=bool(training.enable_cpu_offload), ac=ac_kind(job_config),
        ac_name=f'"{job_config.activation_checkpoint.mode}"', **model,
    )
