"""Small constant tensors (head indices, kernel markers) made once per device and reused:
a host-to-device copy per call would stall the GPU. Under FakeTensorMode nothing is cached,
since a fake tensor must not outlive its mode."""

from __future__ import annotations

from typing import Callable, Hashable, TypeVar

import torch

T = TypeVar("T")

_cache: dict[Hashable, object] = {}


def made_once(key: Hashable, make: Callable[[], T]) -> T:
    """``make()``'s result, made on the first call for ``key`` (fresh each call under fake mode)."""
    if torch._guards.detect_fake_mode() is not None:
        return make()
    if key not in _cache:
        _cache[key] = make()
    return _cache[key]
