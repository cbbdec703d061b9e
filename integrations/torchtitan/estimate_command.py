"""``python -m upipe_compile.estimate --config JOB [--module MODULE]``: the torchtitan job source
of the estimate's command line (entry point ``torchtitan`` in the group
``upipe_compile.estimate_jobs``; upipe_compile.estimate.job_sources calls :func:`command`).

Every argument the command line does not know is a torchtitan override, parsed by torchtitan's
own ConfigManager.
"""

from __future__ import annotations

import json
from dataclasses import asdict

from upipe_compile.estimate.cli_format import format_report, max_context_output
from upipe_compile.integrations.torchtitan.estimate_plan import format_plan, plan
from upipe_compile.integrations.torchtitan.estimate_release import installed_release
from upipe_compile.integrations.torchtitan.estimate_run import estimate
from upipe_compile.integrations.torchtitan.estimate_search import max_context


def command(args, overrides: list[str]) -> int:
    """Estimate the job of ``--config`` (a TOML, or with ``--module`` a 0.3 config function) with
    ``overrides``: one step, ``--max-context`` or ``--plan``; prints the report, 0."""
    job_config = installed_release().load_config(args.config, overrides, module=args.module)
    budgets = dict(gpu_gib=args.gpu_gib, gpus_per_node=args.gpus_per_node, host_gib=args.host_gib,
                   cuda_kernel=args.cuda_kernel, device_ratio=args.device_ratio)
    if args.max_context:
        found, result, probes, bound = max_context(job_config, progress=not args.json, **budgets)
        payload, text = max_context_output(found, result, probes, bound, gpu_gib=args.gpu_gib,
                                           host_gib=args.host_gib)
    elif args.plan:
        found = plan(job_config, **budgets)
        payload = {"plan": found.settings, "overrides": found.overrides(), "seconds": found.seconds,
                   "tried": found.tried, "estimate": asdict(found.result)}
        text = format_plan(found)
    else:
        result = estimate(job_config, **budgets)
        payload, text = result.as_json(), format_report(result)
    print(json.dumps(payload) if args.json else text)
    return 0
