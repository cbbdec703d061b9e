"""The fastest setting of a torchtitan job that fits: ``python -m upipe_compile.estimate --config
JOB --plan``.

Candidates are the job with each combination of the settings that trade memory for speed:
U (``heads_per_stage``: multiples of the all-to-all ranks dividing the heads), ``ring_degree``
(divisors of CP), and under full activation checkpointing ``keep_attention`` and
``offload_block_inputs``. The step-time model (step_time.py) orders them, fastest first (at
equal speed: without offload, then without keep, which use less host memory); the memory
estimate then runs on each in that order, and the first that fits both the GPU and the host
is the plan. Tile sizes (``mlp_tile_tokens``, ``loss_chunk_tokens``) stay as the job sets them:
they cost no modelled time.
"""

from __future__ import annotations

import copy

import torch
from dataclasses import dataclass

from upipe_compile.errors import UnsupportedAttention
from upipe_compile.estimate.cli_format import format_report
from upipe_compile.estimate.errors import JobError
from upipe_compile.estimate.report import Estimate
from upipe_compile.estimate.step_time import ModelShape, step_time
from upipe_compile.integrations.torchtitan.config import upipe_config
from upipe_compile.integrations.torchtitan.estimate_run import estimate, step_setup

MAX_ESTIMATES = 12
KNOBS = ("heads_per_stage", "ring_degree", "keep_attention", "offload_block_inputs")


@dataclass
class Plan:
    settings: dict
    """The chosen values of KNOBS."""
    result: Estimate
    seconds: float
    """The step-time model's seconds per step for the plan."""
    tried: list[tuple[dict, float, str]]
    """(settings, modelled seconds, "fits" / the bound it broke / why it cannot run), in order."""
    as_given: dict
    """The job's own values of KNOBS."""

    def overrides(self) -> list[str]:
        """The settings as command-line overrides: ``--upipe.key value``; a flag for true, and
        ``--upipe.no-key`` where the job sets true and the plan false."""
        out = []
        for key, value in self.settings.items():
            if isinstance(value, bool):
                out += [f"--upipe.{key}"] if value else [f"--upipe.no-{key}"] if self.as_given[key] else []
            else:
                out += [f"--upipe.{key}", str(value)]
        return out


def candidates(job_config, q_heads: int, full_ac: bool) -> list[dict]:
    cp = job_config.parallelism.context_parallel_degree
    flags = (False, True) if full_ac else (False,)
    found = []
    for ring in (r for r in range(1, cp + 1) if cp % r == 0):
        a2a = cp // ring
        for u in (a2a * k for k in range(1, q_heads // a2a + 1) if q_heads % (a2a * k) == 0):
            for keep in flags:
                for offload in flags:
                    found.append(dict(zip(KNOBS, (u, ring, keep, offload))))
    return found


def with_settings(job_config, settings: dict):
    config = copy.deepcopy(job_config)
    cfg = upipe_config(config)
    for key, value in settings.items():
        setattr(cfg, key, value)
    return config


def plan(job_config, *, max_estimates: int = MAX_ESTIMATES, **estimate_kwargs) -> Plan:
    """The fastest candidate that fits (see the module's docstring); JobError when none of the
    first ``max_estimates`` in speed order does."""
    first = estimate(job_config, **estimate_kwargs)
    shape = ModelShape(**first.step_time["shape"])
    full_ac = step_setup(job_config, first.heads_per_stage, first.ring_degree).full_ac
    timed = []
    for settings in candidates(job_config, shape.q_heads, full_ac):
        setup = step_setup(with_settings(job_config, settings), settings["heads_per_stage"], settings["ring_degree"])
        timed.append((step_time(shape, setup).total, settings["offload_block_inputs"], settings["keep_attention"],
                      settings))
    timed.sort(key=lambda t: t[:3])
    as_given = {key: getattr(upipe_config(job_config), key) for key in KNOBS}
    as_given["heads_per_stage"], as_given["ring_degree"] = first.heads_per_stage, first.ring_degree
    tried = []
    for seconds, _, _, settings in timed[:max_estimates]:
        torch._dynamo.reset()  # each setting compiles its own graphs: no recompile limit across them
        try:
            result = first if settings == as_given else estimate(with_settings(job_config, settings), **estimate_kwargs)
        except (JobError, UnsupportedAttention) as error:
            tried.append((settings, seconds, f"cannot run: {str(error).splitlines()[-1].strip()}"))
            continue
        if result.fits:
            tried.append((settings, seconds, "fits"))
            return Plan(settings, result, seconds, tried, as_given)
        broke = " and ".join(n for n, ok in (("device", result.fits_device), ("host", result.fits_host)) if not ok)
        tried.append((settings, seconds, f"breaks the {broke} budget"))
    raise JobError(f"none of the {len(tried)} fastest settings fits at [training] seq_len = "
                   f"{job_config.training.seq_len:,}: lower it, or raise [parallelism] context_parallel_degree. Tried: "
                   + "; ".join(", ".join(f"{k}={v}" for k, v in s.items()) + f" ({outcome})" for s, _, outcome in tried))


def format_plan(found) -> str:
    lines = [f"plan: {' '.join(found.overrides()) or '(the job as given)'}",
             "  " + ", ".join(f"{k} = {v}" for k, v in found.settings.items()),
             f"  modelled step {found.seconds:.4g} s; Ulysses at this context "
             f"{found.result.step_time['methods_seconds']['ulysses']:.4g} s "
             f"({found.result.step_time['methods_seconds']['ulysses'] / found.seconds:.3f}x its throughput)",
             "settings tried, fastest first:"]
    for settings, seconds, outcome in found.tried:
        lines.append(f"  {seconds:10.4g} s  " + ", ".join(f"{k}={v}" for k, v in settings.items()) + f": {outcome}")
    return "\n".join(lines + ["the plan's estimate:", format_report(found.result)])
