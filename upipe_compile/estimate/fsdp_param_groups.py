"""torch's FSDPMemTracker on FSDP modules that hold several parameter groups.

A ``fully_shard`` call whose ``shard_placement_fn`` gives some parameters their own mesh
makes one parameter group per mesh: torchtitan 0.3 shards a MoE block's experts over its
"efsdp" mesh beside expert parallelism, and the block's other parameters over "fsdp", in one
call. torch's tracker reads a module's single group (``FSDPState._fsdp_param_group``, which
asserts there is at most one). While :class:`ParamGroupsTracker` tracks, that property answers
a module's first group, and the tracker instruments the other groups itself as torch's does
the first: their sharded parameters and gradients counted as such from the start, their
unsharded parameters and gradients labelled, their pre- and post-backward snapshotted.
"""

from __future__ import annotations

from contextlib import contextmanager

from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState


def param_groups(state: FSDPState) -> list:
    """Every parameter group of an FSDP module's state (torch builds without per-parameter
    meshes keep the one group alone)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = state._fsdp_param_group
    return [] if group is None else [group]


@contextmanager
def _first_group_answers():
    original = FSDPState.__dict__.get("_fsdp_param_group")
    if not isinstance(original, property):  # a torch whose states hold one group, as an attribute
        yield
        return
    FSDPState._fsdp_param_group = property(lambda state: next(iter(param_groups(state)), None))
    try:
        yield
    finally:
        FSDPState._fsdp_param_group = original


class ParamGroupsTracker(FSDPMemTracker):
    """FSDPMemTracker that follows every parameter group of each FSDP module."""

    def __init__(self, mod, optm=None) -> None:
        super().__init__(mod, optm)
        self._other_groups: dict = {}
        """Each instrumented group after a module's first -> its own (pre_backward, post_backward)."""
        self._first_group = None

    def _register_module_and_optimizer_hooks(self) -> None:
        self._first_group = _first_group_answers()
        self._first_group.__enter__()
        try:
            super()._register_module_and_optimizer_hooks()
        except BaseException:  # the tracker is not entered: nothing will deregister
            self._first_group.__exit__(None, None, None)
            self._first_group = None
            raise
        for module in self._root_mod.modules():
            if not isinstance(module, FSDPModule):
                continue
            for group in param_groups(module._get_fsdp_state())[1:]:
                self._instrument_fsdp_sharded_params_grads(group)
                self._other_groups[group] = (group.pre_backward, group.post_backward)
                group.pre_backward = self._fsdp_param_group_pre_backward(module, group.pre_backward)
                group.post_backward = self._other_group_post_backward(module, group)

    def _deregister_module_and_optimizer_hooks(self) -> None:
        try:
            super()._deregister_module_and_optimizer_hooks()
            for group, (pre_backward, post_backward) in self._other_groups.items():
                group.pre_backward, group.post_backward = pre_backward, post_backward
            self._other_groups.clear()
        finally:
            if self._first_group is not None:
                self._first_group.__exit__(None, None, None)
                self._first_group = None

    def _fsdp_state_pre_forward(self, fsdp_mod, orig_fsdp_state_pre_fw):
        first = super()._fsdp_state_pre_forward(fsdp_mod, orig_fsdp_state_pre_fw)

        def pre_forward(*args, **kwargs):
            result = first(*args, **kwargs)
            for group in param_groups(fsdp_mod._get_fsdp_state())[1:]:
                for fsdp_param in group.fsdp_params:
                    self._update_and_maybe_create_winfos(fsdp_param.unsharded_param, _FSDPRefType.UNSHARDED_PARAM)
            return result

        return pre_forward

    def _other_group_post_backward(self, fsdp_mod, group):
        # torch's wrapper snapshots the module around the group's post-backward (and labels
        # the first group's gradients): this one labels this group's
        snapshotted = self._fsdp_param_group_post_backward(fsdp_mod, group.post_backward)

        def post_backward(*args, **kwargs):
            for fsdp_param in group.fsdp_params:
                unsharded_grad = fsdp_param._unsharded_param.grad
                if unsharded_grad is not None:
                    self._update_and_maybe_create_winfos(unsharded_grad, _FSDPRefType.UNSHARDED_GRAD,
                                                         update_existing=True)
            snapshotted(*args, **kwargs)
            for fsdp_param in group.fsdp_params:
                sharded_grad = fsdp_param.sharded_param.grad
                if sharded_grad is not None:
                    self._update_and_maybe_create_winfos(sharded_grad, _FSDPRefType.SHARDED_GRAD)

        return post_backward
