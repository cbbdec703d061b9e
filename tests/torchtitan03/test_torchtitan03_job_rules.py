"""torchtitan 0.3's job check asks job_rules.py: every bad job of tests/torchtitan_job_cases.py
is refused for the same reason as on 0.2.2 (tests/test_torchtitan_job_rules.py), in the
Python config's spelling: the stack's checks included, which 0.3 did not ask before."""

from __future__ import annotations

import pytest

import tt03_jobs as jobs
from torchtitan_job_cases import cases_of


def refusal_of(case) -> str:
    """The 0.3 Trainer's refusal of ``case``, as the CPU debug config with its changes."""
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    from upipe_compile.errors import UnsupportedAttention
    from upipe_compile.integrations.torchtitan.release_03.trainer import take_over

    config = jobs.load_config(*case.overrides)
    for key, value in case.upipe.items():
        setattr(config.upipe, key, value)
    if case.selective_ac:
        config.activation_checkpoint = SelectiveAC.Config()
    with pytest.raises(UnsupportedAttention) as info:
        take_over(config)
    return str(info.value)


@pytest.mark.parametrize("case", cases_of("0.3"), ids=[case.name for case in cases_of("0.3")])
def test_bad_jobs_are_refused_for_the_tables_reason(case):
    from upipe_compile.integrations.torchtitan.release_03.facts import SPELLING

    message = refusal_of(case)
    assert message.startswith('torchtitan job cannot run with compile.backend = "upipe":\n')
    assert f"  - {case.reason(SPELLING)}" in message
