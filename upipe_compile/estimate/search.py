"""The largest seq_len that fits: few probes, because a step's memory is near-linear in seq_len.

Two probes give a line; its crossing of the budget is probed next; then secant steps on the
two probes nearest the boundary, one fitting and one not, until they are one grid step apart
(the grid: multiples of 1024 x CP degree) or the probe budget is spent. The answer is always
a probed seq_len that fits.
"""

from __future__ import annotations

import copy

from upipe_compile.estimate import H100_80GB_GIB, Estimate, JobError, estimate
from upipe_compile.estimate.gpu import budget_gib

MAX_PROBES = 8


def grid_step(job_config) -> int:
    return 1024 * job_config.parallelism.context_parallel_degree


def _probe(job_config, seq_len: int, **kwargs) -> Estimate:
    config = copy.deepcopy(job_config)
    config.training.seq_len = seq_len
    return estimate(config, **kwargs)


def max_context(job_config, *, gpu_gib: float = H100_80GB_GIB, gpus_per_node: int = 8, progress: bool = True,
                max_probes: int = MAX_PROBES, cuda_kernel: str = "flash-attn"):
    """(largest fitting seq_len, its Estimate, [(seq_len, peak GiB), ...] probed)."""
    from tqdm import tqdm

    step = grid_step(job_config)
    limit = budget_gib(gpu_gib)
    first = max(step, job_config.training.seq_len // step * step)
    results: dict[int, Estimate] = {}
    bar = tqdm(total=max_probes, desc="max-context probes", unit="probe", disable=not progress)

    def probe(seq_len: int) -> Estimate:
        if seq_len not in results:
            bar.set_postfix_str(f"seq_len {seq_len:,}")
            results[seq_len] = _probe(job_config, seq_len, gpu_gib=gpu_gib, gpus_per_node=gpus_per_node,
                                      cuda_kernel=cuda_kernel)
            bar.update(1)
        return results[seq_len]

    def crossing(a: int, b: int) -> int:
        pa, pb = results[a].peak_device_gib, results[b].peak_device_gib
        slope = (pb - pa) / (b - a)
        if slope <= 0:
            raise JobError("memory does not grow with [training] seq_len; cannot search a maximum")
        return max(step, int((a + (limit - pa) / slope) // step * step))

    try:
        probe(first)
        probe(2 * first if results[first].fits else max(step, first // 2 // step * step))
        while len(results) < max_probes:
            fitting = [s for s, r in results.items() if r.fits]
            over = [s for s, r in results.items() if not r.fits]
            lo = max(fitting) if fitting else None
            hi = min(over) if over else None
            if lo is not None and hi is not None and hi - lo <= step:
                break
            if lo is None and min(results) == step:
                raise JobError(f"even [training] seq_len = {step} (1024 x CP) does not fit {gpu_gib} GiB")
            near = sorted(results, key=lambda s: abs(results[s].peak_device_gib - limit))[:2]
            guess = crossing(min(near), max(near))
            if lo is not None and hi is not None:
                guess = min(max(guess, lo + step), hi - step)  # stay strictly inside the bracket
            elif lo is not None:
                guess = max(guess, lo + step)
            else:
                guess = min(guess, hi - step)
            if guess in results:  # the line keeps pointing at a probed length: close in by one step
                guess = lo + step if lo is not None and lo + step not in results else hi - step
            probe(guess)
    finally:
        bar.close()
    fitting = [s for s, r in results.items() if r.fits]
    if not fitting:
        raise JobError(f"no probed [training] seq_len fits {gpu_gib} GiB (smallest probed: {min(results):,})")
    best = max(fitting)
    probes = [(s, results[s].peak_device_gib) for s in sorted(results)]
    return best, results[best], probes
