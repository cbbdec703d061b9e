"""Who made a tensor: upipe's attention ops report their outputs here as each call returns them.

A compiled block saves its tensors for backward as anonymous graph values; the block-input
offloader (:mod:`upipe_compile.stack.offload`) listens while a block runs forward to tell the
attention outputs that ``keep_attention`` saves from the rest. Nothing listens otherwise, and a
report is then one attribute read."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

_state = threading.local()


def report(*tensors: torch.Tensor) -> None:
    """Called by the ops' implementations (real and fake) with the tensors they return."""
    listener = getattr(_state, "listener", None)
    if listener is not None:
        listener(tensors)


@contextmanager
def listening(listener: Callable[[tuple], None]) -> Iterator[None]:
    """Send every report made inside the block to ``listener`` (one listener at a time)."""
    previous = getattr(_state, "listener", None)
    _state.listener = listener
    try:
        yield
    finally:
        _state.listener = previous
