"""Offload the checkpointed input of each transformer block to host memory after the block's
forward and bring it back just before the block's recompute.

Under full activation checkpointing a block saves, for backward, its input and nothing else of
the sequence's size (its parameters and the RoPE table are saved too; they are not
activations). The offloader wraps each block's call in ``torch.autograd.graph.saved_tensors_hooks``
and moves to host exactly the saved tensors that *are* the block's input (same data, shape,
strides); every other saved tensor is left as it is. This sees the same tensor whichever way
the block is built:

- eager ``checkpoint_wrapper``: the non-reentrant checkpoint saves its inputs through the
  outer hooks (its own hooks only catch what runs inside);
- a torch.compile'd block: the compiled autograd function saves its forward graph's saved
  tensors, the block input among them, through the hooks when its forward returns;
- FSDP2 around either: its pre-forward hook hands the block an alias of the input (same
  data), and the unsharded parameters it saves are not the input.

On CUDA the device-to-host copy runs on a side stream into pinned memory, overlapped with the
block's own compute. The copy back starts when the gradient of the block's output arrives
(block i+1's backward is done), overlapped with FSDP's all-gather of the block's parameters:
starting it earlier, during block i+1's backward, would hold a second block input on the GPU
at the step's peak (block i+1's attention backward) for a copy that takes well under a
percent of a block's backward at these lengths. On CPU the same code runs with synchronous
copies (what the tests exercise).
"""

from __future__ import annotations

import logging
import os
import weakref
from contextlib import nullcontext
from typing import Sequence

import torch
import torch.nn as nn

log = logging.getLogger(__name__)


# --- how much host memory ------------------------------------------------------------------
def host_bytes_per_rank(n_blocks: int, tokens_per_rank: int, dim: int, dtype: torch.dtype) -> int:
    """Host memory the offloaded block inputs take on one rank: one [tokens, dim] input per block.
    ``tokens_per_rank`` = local batch x seq_len / CP degree."""
    return n_blocks * tokens_per_rank * dim * torch.empty((), dtype=dtype).element_size()


def total_host_memory_bytes(meminfo: str = "/proc/meminfo") -> int:
    """The node's RAM: MemTotal from /proc/meminfo, else physical pages x page size."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024  # the file says kB and means KiB
    except OSError:
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def ranks_per_node(default: int) -> int:
    """Processes sharing this node's RAM: torchrun's LOCAL_WORLD_SIZE, else ``default``."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", default))


def host_memory_problem(bytes_per_rank: int, ranks: int, total_bytes: int, reserve_bytes: int) -> str | None:
    """Why the node cannot hold ``ranks`` x ``bytes_per_rank`` of offloaded inputs next to
    ``reserve_bytes`` for everything else, or None."""
    need = bytes_per_rank * ranks
    if need + reserve_bytes <= total_bytes:
        return None
    return (f"offloading block inputs needs {_size(bytes_per_rank)} of host memory per rank x {ranks} "
            f"ranks per node = {_size(need)}, plus a reserve of {_size(reserve_bytes)}, but the "
            f"node has {_size(total_bytes)}")


def _size(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


# --- the copies ------------------------------------------------------------------------------
class _Copier:
    """Device <-> host copies: on a side stream with events on CUDA, synchronous elsewhere."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    def _on_side_stream(self):
        return torch.cuda.stream(self.stream) if self.cuda else nullcontext()

    def start(self, src: torch.Tensor, dst_device: torch.device):
        """Start copying ``src`` to ``dst_device``; returns (copy, event or None)."""
        if not self.cuda:
            return src.to(dst_device, copy=True), None
        self.stream.wait_stream(torch.cuda.current_stream(src.device if src.is_cuda else None))
        with self._on_side_stream():
            pinned = dst_device.type == "cpu"
            dst = torch.empty(src.shape, dtype=src.dtype, device=dst_device, pin_memory=pinned)
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        # The caching allocator must not hand src's (or a device dst's) memory to another
        # stream's work before the side stream is done with it.
        for t in (src, dst):
            if t.is_cuda:
                t.record_stream(self.stream)
        return dst, event

    def finish(self, dst: torch.Tensor, event) -> torch.Tensor:
        """Make the current stream wait for the copy into ``dst``."""
        if event is not None:
            torch.cuda.current_stream().wait_event(event)
            if dst.is_cuda:
                dst.record_stream(torch.cuda.current_stream())
        return dst


class _OffloadedInput:
    """One block's saved input, on host between its forward and its recompute."""

    def __init__(self, offloader: "BlockInputOffloader", block_index: int, tensor: torch.Tensor):
        self.offloader, self.block_index = offloader, block_index
        self.device = tensor.device
        self.host, self.host_event = offloader.copier.start(tensor, offloader.host_device)
        self.fetched = None  # (device tensor, event) once a prefetch has started

    def prefetch(self) -> None:
        if self.fetched is None:
            self.offloader.copier.finish(self.host, self.host_event)  # D2H done before H2D
            self.fetched = self.offloader.copier.start(self.host, self.device)

    def unpack(self) -> torch.Tensor:
        self.prefetch()
        tensor, event = self.fetched
        self.fetched = None  # the autograd node owns it now; a second unpack copies again
        return self.offloader.copier.finish(tensor, event)


class BlockInputOffloader:
    """Installs the offload hooks on ``blocks`` (the modules the model calls in order, e.g.
    the FSDP/compiled/checkpoint-wrapped transformer blocks). ``remove()`` uninstalls them.
    ``host_device`` is where inputs wait ("cpu"; a memory estimate on fake tensors may pass
    "meta" to keep host bytes apart from device bytes).

    ``offloaded_last_step`` counts the tensors moved to host since the first block's last
    forward, and ``offloaded_bytes_last_step`` their bytes (what :func:`host_bytes_per_rank`
    predicts)."""

    def __init__(self, blocks: Sequence[nn.Module], host_device: torch.device | str = "cpu"):
        self.blocks = list(blocks)
        if not self.blocks:
            raise ValueError("BlockInputOffloader needs at least one block")
        self.host_device = torch.device(host_device)
        self.copier = None
        self._current: tuple[int, torch.Tensor] | None = None  # (block index, its input) during a forward
        self._context = None
        self._by_block: dict[int, weakref.ref] = {}
        self.offloaded_last_step = 0
        self.offloaded_bytes_last_step = 0
        self._handles = []
        for index, block in enumerate(self.blocks):
            self._handles.append(block.register_forward_pre_hook(self._pre_hook(index), with_kwargs=True))
            self._handles.append(block.register_forward_hook(self._post_hook, always_call=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _pre_hook(self, index: int):
        def hook(module, args, kwargs):
            x = args[0] if args else next(iter(kwargs.values()))
            if not torch.is_grad_enabled() or not isinstance(x, torch.Tensor):
                return None
            if self.copier is None:
                self.copier = _Copier(x.device)
            if index == 0:
                self._by_block.clear()
                self.offloaded_last_step = self.offloaded_bytes_last_step = 0
            self._current = (index, x)
            self._context = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._context.__enter__()
            return None
        return hook

    def _post_hook(self, module, args, output):
        if self._context is not None:
            (index, _), context = self._current, self._context
            self._context = self._current = None
            context.__exit__(None, None, None)
            if isinstance(output, torch.Tensor) and output.requires_grad and index in self._by_block:
                output.register_hook(self._fetch_when_backward_arrives(index))
        return None

    def _fetch_when_backward_arrives(self, index: int):
        """A hook on block ``index``'s output: its gradient is there, so the block's backward
        (and the recompute that needs its input) comes next: start the copy back."""
        def hook(_grad):
            handle = self._by_block.get(index)
            handle = handle() if handle is not None else None
            if handle is not None:
                handle.prefetch()
        return hook

    def _pack(self, tensor: torch.Tensor):
        index, x = self._current
        if not _same_view(tensor, x):
            return tensor
        existing = self._by_block.get(index)
        handle = existing() if existing is not None else None
        if handle is None:  # the same input saved twice shares one host copy
            handle = _OffloadedInput(self, index, tensor)
            self._by_block[index] = weakref.ref(handle)
            self.offloaded_last_step += 1
            self.offloaded_bytes_last_step += tensor.numel() * tensor.element_size()
        return handle

    def _unpack(self, packed):
        if not isinstance(packed, _OffloadedInput):
            return packed
        return packed.unpack()  # copies now unless the output-gradient hook started it


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Storage identity rather than data_ptr(): fake tensors (the memory estimate) have none.
    return (a.device == b.device and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            and a.storage_offset() == b.storage_offset() and torch._C._is_alias_of(a, b))
