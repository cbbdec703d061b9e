"""FSDP over a gloo process group (the CPU tests' and the estimate's), for both torchtitan releases."""

from __future__ import annotations

import torch.nn as nn


def sum_reductions_on_gloo(model: nn.Module, dp_mesh) -> None:
    """torchtitan sets FSDP's gradient divide factor to 1.0 (it scales the loss by the global
    token count instead); FSDP2 then reduce-scatters with ReduceOp.PREMUL_SUM(1.0), which gloo
    rejects ("Cannot use ReduceOp.PREMUL_SUM with Gloo"). On gloo, ask FSDP for plain SUM
    reductions (its divide by 1.0 is exact). NCCL is left as torchtitan configures it."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    groups = [dp_mesh.get_group(i) for i in range(dp_mesh.ndim)]
    if not any(dist.get_backend(g) == "gloo" for g in groups):
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
