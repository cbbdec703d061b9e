"""The largest seq_len that fits both the GPU and the node's host memory: few probes, because
a step's device peak is near-linear in seq_len and its host memory (the offloaded block
inputs) is linear in it.

"Fits" is both bounds: the per-rank device peak within the GPU's budget (gpu.py) and the
offloaded activations of one node within the host budget (upipe_compile.stack.host_memory). Two probes give a line
per bound; the nearer of the lines' crossings of their budgets is probed next; then secant
steps on the two probes nearest each budget, staying inside the bracket of a fitting and a
non-fitting probe, until these are one grid step apart (the grid: multiples of 1024 x CP
degree) or the probe budget is spent. The answer is always a probed seq_len that fits; the
bound that stopped it is the one the smallest longer probe broke ("device", "host", or
"device and host").
"""

from __future__ import annotations

import math

from upipe_compile.estimate.errors import JobError
from upipe_compile.estimate.gpu import budget_gib
from upipe_compile.estimate.report import Estimate

MAX_PROBES = 8


def bound_of(result) -> str:
    """Which budget a probe that does not fit breaks."""
    return " and ".join(name for name, ok in (("device", result.fits_device), ("host", result.fits_host)) if not ok)


def search(estimate_at, seq_len: int, step: int, *, gpu_gib: float, host_gib: float, progress: bool = True,
           max_probes: int = MAX_PROBES, name: str = "seq_len"):
    """The max-context search over any job: ``estimate_at(seq_len)`` is its Estimate at a length,
    ``seq_len`` the first probe (rounded to the grid of ``step``), ``name`` what messages call
    the length. Returns (largest fitting seq_len, its Estimate, [(seq_len, peak GiB), ...]
    probed, the bound that stopped it: "device", "host", "device and host", or None when the
    probes ran out before any longer probe failed). The job sources' searches: the torchtitan
    integration's ``estimate_search.max_context``, the transformers one's
    ``hf_estimate.max_context_hf``."""
    from tqdm import tqdm

    limits = {"device": budget_gib(gpu_gib), "host": host_gib}
    measures = {"device": lambda r: r.expected_device_peak_gib, "host": lambda r: r.host_gib_per_node}
    first = max(step, seq_len // step * step)
    results: dict[int, Estimate] = {}
    bar = tqdm(total=max_probes, desc="max-context probes", unit="probe", disable=not progress)

    def probe(seq_len: int) -> Estimate:
        if seq_len not in results:
            bar.set_postfix_str(f"seq_len {seq_len:,}")
            results[seq_len] = estimate_at(seq_len)
            bar.update(1)
        return results[seq_len]

    def crossing(kind: str) -> float:
        """Where the line through the two probes nearest this bound's budget crosses it
        (inf when the measure does not grow: no host memory without offload)."""
        limit, measure = limits[kind], measures[kind]
        near = sorted(results, key=lambda s: abs(measure(results[s]) - limit))[:2]
        a, b = min(near), max(near)
        slope = (measure(results[b]) - measure(results[a])) / (b - a)
        if slope <= 0:
            if kind == "device":
                raise JobError(f"memory does not grow with {name}; cannot search a maximum")
            return math.inf
        return a + (limit - measure(results[a])) / slope

    def describe() -> str:
        return f"{gpu_gib} GiB of GPU and {host_gib} GiB of host memory per node"

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
                raise JobError(f"even {name} = {step} (1024 x CP) does not fit {describe()} "
                               f"(breaks the {bound_of(results[step])} budget)")
            line = min(crossing("device"), crossing("host"))
            guess = max(step, int(line // step * step)) if math.isfinite(line) else step
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
        raise JobError(f"no probed {name} fits {describe()} (smallest probed: {min(results):,}, "
                       f"which breaks the {bound_of(results[min(results)])} budget)")
    best = max(fitting)
    longer = [s for s, r in results.items() if s > best and not r.fits]
    bound = bound_of(results[min(longer)]) if longer else None
    probes = [(s, results[s].expected_device_peak_gib) for s in sorted(results)]
    return best, results[best], probes, bound
