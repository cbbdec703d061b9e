"""torchtitan 0.2.2's job check asks job_rules.py: every bad job of torchtitan_job_cases.py is
refused for the reason the table gives, in the TOML's spelling (tests/torchtitan03 asks 0.3's
check the same table). The rules also run on the facts alone."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from torchtitan_job_cases import cases_of
from torchtitan_jobs import DEBUG_TOML, load_config
from upipe_compile.errors import UnsupportedAttention


def refusal_of(case) -> str:
    """The 0.2.2 check's refusal of ``case``, as the debug TOML with its changes."""
    import upipe_compile.integrations.torchtitan  # noqa: F401  registers the spec
    from torchtitan.protocols.train_spec import get_train_spec

    from upipe_compile.integrations.torchtitan.release_022.estimate import parallel_dims_of
    from upipe_compile.integrations.torchtitan import check_job

    mode = "selective" if case.selective_ac else "full"
    config = load_config(DEBUG_TOML, f"--activation_checkpoint.mode={mode}", "--activation_checkpoint.selective_ac_option=op",
                         *case.overrides)
    for key, value in case.upipe.items():
        setattr(config.upipe, key, value)
    p = config.parallelism
    dims = parallel_dims_of(config, p.context_parallel_degree * p.tensor_parallel_degree * p.pipeline_parallel_degree)
    spec = get_train_spec("llama3")
    args = spec.model_args["debugmodel_varlen_attn" if case.varlen else "debugmodel"]
    with torch.device("meta"):
        model = spec.model_cls(args)
    with pytest.raises(UnsupportedAttention) as info:
        check_job(config, dims, args, model)
    return str(info.value)


@pytest.mark.parametrize("case", cases_of("0.2.2"), ids=[case.name for case in cases_of("0.2.2")])
def test_bad_jobs_are_refused_for_the_tables_reason(case):
    from upipe_compile.integrations.torchtitan.release_022.facts import SPELLING

    message = refusal_of(case)
    assert message.startswith('torchtitan job cannot run with [compile] backend = "upipe":\n')
    assert f"  - {case.reason(SPELLING)}" in message


def test_the_rules_on_facts_alone():
    """job_rules.py needs no config: facts in, refusals out, spelled as the facts say."""
    from upipe_compile.integrations.torchtitan.config import UPipe
    from upipe_compile.integrations.torchtitan.job_rules import JOB_RULES, STACK_RULES, job_problems
    from upipe_compile.integrations.torchtitan.release_022.facts import SPELLING

    fine = _facts(SPELLING, UPipe())
    assert job_problems(fine) == []
    bad = dataclasses.replace(fine, upipe=UPipe(host_memory_reserve_gib=-2, ring_degree=0), seq_len=1001)
    assert job_problems(bad, STACK_RULES) == ["[upipe] host_memory_reserve_gib = -2 must be a number >= 0 (or -1: scaled to the node)"]
    assert job_problems(bad, JOB_RULES) == [
        "[upipe] host_memory_reserve_gib = -2 must be a number >= 0 (or -1: scaled to the node)",
        "[upipe] ring_degree = 0 must be >= 1 (1 = no ring)",
        "[training] seq_len = 1001 must be divisible by the CP degree 2 ([parallelism] context_parallel_degree)",
    ]
    assert job_problems(dataclasses.replace(fine, model_name=None, moe=None, attention=None, n_heads=None)) == []


def _facts(spelling, upipe):
    from upipe_compile.integrations.torchtitan.job_rules import JobFacts

    return JobFacts(spelling=spelling, upipe=upipe, cp=2, seq_len=1024, local_batch_size=1,
                    compile_components=("model",), other_degrees={"tensor_parallel_degree": 1}, ac="full",
                    ac_name='"full"', model_name="llama3", moe=False, attention="varlen", n_heads=(16,))
