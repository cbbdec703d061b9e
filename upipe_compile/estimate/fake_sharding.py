"""DTensor's sharding propagation kept out of the estimate's memory tracker."""

from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def private_sharding_fake_mode():
    """DTensor's sharding propagation computes output metadata on fake tensors of the *global*
    shapes, in the ambient FakeTensorMode when there is one. The memory tracker then counts
    those unsharded-size scratch tensors as allocations (the optimizer state came out 17x
    too large). Run the propagation in a fake mode of its own with every dispatch mode off, the
    tracker too (torch 2.11's tracker also sees a fresh mode's scratch tensors)."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.utils._python_dispatch import _disable_current_modes

    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def propagate(self, op_schema):
        with _disable_current_modes():
            return original(self, op_schema)

    ShardingPropagator._propagate_tensor_meta_non_cached = propagate
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original
