"""The whole-step estimate against a measurement that shares none of its code:
one real training step of the scaled debug model on 2 gloo ranks, the stack on (offloaded
block inputs, tiled MLP, chunked loss), under torch.profiler(profile_memory=True), against
``estimate(job, cuda_kernel=None)`` for the same job. benchmarks/estimate_check.py runs the
same comparison at a size of a few GiB; docs/estimate.md, "Checked against a measurement".

The one term the estimate leaves out is explained and bounded: all-to-all buffers that
gloo keeps past their use on a CPU run ("retained": allocated before the peak and still live
at the step's end, not a gradient; or an all-to-all's buffer live at a peak outside the
attention ops, which keep none past their own call). Without it, estimate and measurement agree within 5 % for
the whole peak (an estimate without the offloaded inputs, 14 % of it here, or with an untiled
MLP fails that), and within 8 % for the step's rise above its start alone."""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import estimate_check  # noqa: E402

pytest.importorskip("torchtitan")


@pytest.fixture(scope="module")
def compared(rank_pools):
    return estimate_check.compare(estimate_check.SMALL, rank_pools(2))


def test_estimated_peak_matches_the_profiled_step_on_every_rank(compared):
    _, ranks, rows = compared
    for row, m in zip(rows, ranks):
        # what the run offloaded is what the estimate holds on the host
        assert m["offloaded"] == m["start"]["host_buffers"] > 0
        assert abs(row["ratio without it"] - 1) <= 0.05, row
        # the rise alone (two thirds of the peak here): gloo may also hold buffers past their
        # use that it frees before the step's end, which "retained" does not count
        assert abs(row["rise ratio without it"] - 1) <= 0.08, row


def test_the_explained_term_is_small_and_only_that(compared):
    _, ranks, rows = compared
    for row, m in zip(rows, ranks):
        rise = m["rise"]
        assert m["terms"]["retained"] <= 0.3 * rise, m["terms"]
        # the terms found at the peak add up to the measured rise
        parts = m["terms"]["sharded_grads"] + m["terms"]["fsdp_buffers"] + m["terms"]["activations_and_temps"]
        assert abs(parts - rise) <= 0.001 * rise


def test_the_inner_backend_option_reaches_the_job_and_nothing_else():
    # the real step's [upipe] inner_backend; without the option, the TOML's (aot_eager)
    assert estimate_check.job_config(estimate_check.SMALL).upipe.inner_backend == estimate_check.DEFAULT_INNER_BACKEND
    for name in estimate_check.INNER_BACKENDS:
        config = estimate_check.job_config(estimate_check.SMALL, name)
        assert config.upipe.inner_backend == name
        assert config.training.seq_len == estimate_check.SMALL.seq_len


def test_every_backend_of_the_check_passes_upipes_option_check():
    import upipe_compile.options as options

    for name in estimate_check.INNER_BACKENDS:
        assert not options.option_problems(inner_backend=name), name
    assert options.option_problems(inner_backend="no_such_backend")
