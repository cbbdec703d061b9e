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

Host memory: each block has one host buffer of exactly its input's size, made at the block's
first offloaded forward and reused every step (written in the block's forward, read in its
backward; a graph still alive at the next forward keeps its buffer and the step gets a new
one). On CUDA it is plain CPU memory page-locked in place with ``cudaHostRegister``
(:func:`cuda_host_register`), not torch's pinned allocator, which rounds every request up to a
power of two (a 5 GiB input would take 8 GiB); when pinning is refused the buffers stay pageable
(slower, synchronous copies; logged once). :func:`host_bytes_per_rank` is exactly what the
buffers take; what the node's ranks may use together, and whether the buffers fit it, is
:mod:`upipe_compile.stack.host_memory`'s.

On CUDA the device-to-host copy runs on a side stream into the host buffer, overlapped with the
block's own compute. The copy back starts when the gradient of the block's output arrives
(block i+1's backward is done), overlapped with FSDP's all-gather of the block's parameters:
starting it earlier, during block i+1's backward, would hold a second block input on the GPU
at the step's peak (block i+1's attention backward) for a copy that takes well under a
percent of a block's backward at these lengths. On CPU the same code runs with synchronous
copies (what the tests exercise).
"""

from __future__ import annotations

import ctypes
import logging
import weakref
from typing import Callable, Sequence

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake

from upipe_compile.attention import op_outputs
from upipe_compile.stack.host_memory import size_text

log = logging.getLogger(__name__)


# --- the host bytes the buffers take --------------------------------------------------------
def host_bytes_per_rank(n_blocks: int, tokens_per_rank: int, dim: int, dtype: torch.dtype) -> int:
    """Host memory the offloaded block inputs take on one rank: one [tokens, dim] input per block,
    each in a buffer of exactly its size (all the offloader allocates on host).
    ``tokens_per_rank`` = local batch x seq_len / CP degree."""
    return n_blocks * tokens_per_rank * dim * torch.empty((), dtype=dtype).element_size()


# --- pinning -----------------------------------------------------------------------------------
def cuda_host_register(tensor: torch.Tensor) -> Callable[[], None]:
    """Page-lock ``tensor``'s memory where it is, exactly its bytes; returns the undo (which keeps
    the tensor alive until called). Raises RuntimeError when CUDA refuses.

    Not ``tensor.pin_memory()`` or ``torch.empty(..., pin_memory=True)``: both take a block from
    torch's CachingHostAllocator, which rounds each request up to a power of two unless
    ``pinned_max_round_threshold`` is configured (ATen/core/CachingHostAllocator.h), so a 5 GiB
    input would hold 8 GiB of page-locked RAM. torch's own checkpoint stager pins this way too."""
    cudart = torch.cuda.cudart()
    storage = tensor.untyped_storage()
    error = int(cudart.cudaHostRegister(storage.data_ptr(), storage.nbytes(), 0))
    if error:
        _clear_cuda_error()
        raise RuntimeError(f"cudaHostRegister of {size_text(storage.nbytes())} failed with cudaError {error}")

    def unpin():
        if int(cudart.cudaHostUnregister(storage.data_ptr())):
            _clear_cuda_error()
    return unpin


def _clear_cuda_error() -> None:
    # A failed runtime call stays the runtime's "last error" until read, and torch's next kernel
    # launch check would raise it; torch.cuda.cudart() has no cudaGetLastError. Best effort:
    # torch loads libcudart into the global symbol scope.
    try:
        ctypes.CDLL(None).cudaGetLastError()
    except (AttributeError, OSError):
        log.warning("upipe offload: could not clear a failed cudaHostRegister's CUDA error")


def _unpin_when_copies_done(stream, unpin) -> None:
    if stream is not None:
        stream.synchronize()  # the side stream's copies out of / into the buffer
    unpin()


class _HostBuffer:
    """One block's host copy, kept by the offloader and reused every step. Pinned memory is
    unpinned when the buffer is dropped, once the side stream's copies are done."""

    def __init__(self, tensor: torch.Tensor, unpin: Callable[[], None] | None, stream):
        self.tensor, self.pinned = tensor, unpin is not None
        self.user: weakref.ref | None = None  # the _OffloadedInput whose data it holds
        if unpin is not None:
            weakref.finalize(self, _unpin_when_copies_done, stream, unpin).atexit = False

    def reusable_for(self, tensor: torch.Tensor) -> bool:
        # A graph kept alive (retain_graph, two forwards before a backward) still needs the
        # data of the step that wrote it: the next step then gets a new buffer.
        in_use = self.user is not None and self.user() is not None
        return (not in_use and self.tensor.shape == tensor.shape and self.tensor.dtype == tensor.dtype
                and self.tensor.stride() == tensor.stride())


# --- the copies ------------------------------------------------------------------------------
class _Copier:
    """Device <-> host copies: on a side stream with events on CUDA, synchronous elsewhere.
    Every copy runs on the one side stream, so a host buffer's copies happen in the order issued
    (a step's write into a reused buffer after the last step's read out of it)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    def copy(self, src: torch.Tensor, dst: torch.Tensor):
        """Start copying ``src`` into ``dst`` (allocated by the caller on the current stream, so a
        device tensor lives in that stream's pool); returns the event to wait for, None when done."""
        if not self.cuda:
            dst.copy_(src)
            return None
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        # The caching allocator must not hand a device src's or dst's memory to other work
        # before the side stream is done with it.
        for t in (src, dst):
            if t.is_cuda:
                t.record_stream(self.stream)
        return event

    def finish(self, dst: torch.Tensor, event) -> torch.Tensor:
        """Make the current stream wait for the copy into ``dst``."""
        if event is not None:
            torch.cuda.current_stream().wait_event(event)
            if dst.is_cuda:
                dst.record_stream(torch.cuda.current_stream())  # no-op on the stream it came from
        return dst


class _OffloadedTensor:
    """One saved tensor of a block (its input, or a kept attention output), in its host buffer
    between the block's forward and its backward."""

    def __init__(self, offloader: "BlockInputOffloader", key: tuple[int, int], tensor: torch.Tensor):
        self.offloader, self.key = offloader, key
        self.device = tensor.device
        self.source = weakref.ref(tensor)  # to tell a second save of the same tensor
        self.buffer = offloader._host_buffer(key, tensor)
        self.buffer.user = weakref.ref(self)
        offloader.copier.copy(tensor, self.buffer.tensor)  # the copy back follows it on the side stream
        self.fetched = None  # (device tensor, event) once a prefetch has started

    def holds(self, tensor: torch.Tensor) -> bool:
        source = self.source()
        return source is not None and _same_view(tensor, source)

    def prefetch(self) -> None:
        if self.fetched is None:
            host = self.buffer.tensor
            # Allocated here, on the current stream: not in the side stream's pool.
            tensor = torch.empty_like(host, device=self.device)
            self.fetched = tensor, self.offloader.copier.copy(host, tensor)

    def unpack(self) -> torch.Tensor:
        self.prefetch()
        tensor, event = self.fetched
        self.fetched = None  # the autograd node owns it now; a second unpack copies again
        return self.offloader.copier.finish(tensor, event)


class BlockInputOffloader:
    """Installs the offload hooks on ``blocks`` (the modules the model calls in order, e.g.
    the FSDP/compiled/checkpoint-wrapped transformer blocks). ``remove()`` uninstalls them and
    drops the host buffers. ``host_device`` is where inputs wait ("cpu"; a memory estimate on
    fake tensors may pass "meta" to keep host bytes apart from device bytes).

    ``kept_outputs``: also offload the attention outputs a block saves for backward
    (``keep_attention``: upipe's attention ops report them, :mod:`upipe_compile.attention.op_outputs`),
    each to its own buffer, fetched back with the block input. They reach the hooks where the
    block is compiled (the compiled function saves them); an eager selective checkpoint keeps
    them in its own cache, out of reach, which is logged once.

    ``pin(tensor)`` page-locks a new host buffer in place and returns the undo, raising when it
    cannot; by default :func:`cuda_host_register` when the inputs are on CUDA, none otherwise.
    After a refusal the buffers stay pageable (logged once).

    ``offloaded_last_step`` counts the tensors moved to host since the first block's last
    forward, and ``offloaded_bytes_last_step`` their bytes (:func:`host_bytes_per_rank` predicts
    the block inputs' share). :meth:`host_buffer` is block i's input buffer."""

    def __init__(self, blocks: Sequence[nn.Module], host_device: torch.device | str = "cpu",
                 pin: Callable[[torch.Tensor], Callable[[], None]] | None = None, kept_outputs: bool = False):
        self.blocks = list(blocks)
        if not self.blocks:
            raise ValueError("BlockInputOffloader needs at least one block")
        self.host_device = torch.device(host_device)
        self.kept_outputs = kept_outputs
        self._pin, self._pin_refused, self._kept_unreached_said = pin, False, False
        self.copier = None
        self._current: tuple[int, torch.Tensor] | None = None  # (block index, its input) during a forward
        self._reported: list[weakref.ref] = []  # attention outputs made during the current forward
        self._contexts = []
        self._by_block: dict[int, list[weakref.ref]] = {}
        self._buffers: dict[tuple[int, int], _HostBuffer] = {}
        self.offloaded_last_step = 0
        self.offloaded_bytes_last_step = 0
        self._handles = []
        for index, block in enumerate(self.blocks):
            self._handles.append(block.register_forward_pre_hook(self._pre_hook(index), with_kwargs=True))
            self._handles.append(block.register_forward_hook(self._post_hook, always_call=True))

    def host_buffer(self, index: int) -> torch.Tensor | None:
        """Block ``index``'s input buffer (None before its first offloaded forward)."""
        buffer = self._buffers.get((index, 0))
        return buffer.tensor if buffer is not None else None

    def _host_buffer(self, key: tuple[int, int], tensor: torch.Tensor) -> _HostBuffer:
        buffer = self._buffers.get(key)
        if buffer is None or not buffer.reusable_for(tensor):
            host = torch.empty_like(tensor, device=self.host_device)  # exactly the tensor's bytes
            buffer = self._buffers[key] = _HostBuffer(host, self._pinned(host), self.copier.stream)
        return buffer

    def _pinned(self, host: torch.Tensor) -> Callable[[], None] | None:
        """Pin ``host``; the undo, or None when pinning is off or refused (said once)."""
        pin = self._pin or (cuda_host_register if self.copier.cuda else None)
        if pin is None or self._pin_refused or self.host_device.type != "cpu":
            return None
        try:
            return pin(host)
        except RuntimeError as error:
            self._pin_refused = True  # not again: the next block would be refused as well
            log.warning("upipe offload: pinning %s of host memory failed (%s): offloaded block inputs "
                        "stay in pageable memory, their copies are slower and do not overlap compute",
                        size_text(host.numel() * host.element_size()), error)
            return None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._buffers.clear()  # each unpinned once unused (a live graph keeps its own)

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
            self._reported = []
            self._contexts = [torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)]
            if self.kept_outputs:
                self._contexts.append(op_outputs.listening(self._note_outputs))
            for context in self._contexts:
                context.__enter__()
            return None
        return hook

    def _note_outputs(self, tensors: tuple) -> None:
        # Fake tensors are the compiler tracing the block on its first call, not a run.
        self._reported += [weakref.ref(t) for t in tensors if t.numel() and not is_fake(t)]

    def _post_hook(self, module, args, output):
        if self._contexts:
            (index, _), contexts = self._current, self._contexts
            self._contexts, self._current = [], None
            for context in reversed(contexts):
                context.__exit__(None, None, None)
            self._say_if_kept_unreached(index)
            self._reported = []
            if isinstance(output, torch.Tensor) and output.requires_grad and self._by_block.get(index):
                output.register_hook(self._fetch_when_backward_arrives(index))
        return None

    def _say_if_kept_unreached(self, index: int) -> None:
        """An attention output still alive after the forward and not offloaded is held by an
        eager selective checkpoint's cache: it stays on the device."""
        offloaded = [h() for h in self._by_block.get(index, ())]
        for ref in self._reported:
            tensor = ref()
            if tensor is not None and not any(h is not None and h.holds(tensor) for h in offloaded):
                if not self._kept_unreached_said:
                    self._kept_unreached_said = True
                    log.warning("upipe offload: block %d keeps an attention output on the device: only compiled "
                                "blocks hand their kept attention outputs to the offloader", index)
                return

    def _fetch_when_backward_arrives(self, index: int):
        """A hook on block ``index``'s output: its gradient is there, so the block's backward
        (and the recompute that needs its input) comes next: start the copies back."""
        def hook(_grad):
            for ref in self._by_block.get(index, ()):
                handle = ref()
                if handle is not None:
                    handle.prefetch()
        return hook

    def _pack(self, tensor: torch.Tensor):
        index, x = self._current
        if _same_view(tensor, x):
            slot = 0
        elif self.kept_outputs and any(_aliases(tensor, ref()) for ref in self._reported):
            slot = None
        else:
            return tensor
        handles = self._by_block.setdefault(index, [])
        for ref in handles:  # the same tensor saved twice shares one host copy
            handle = ref()
            if handle is not None and handle.holds(tensor):
                return handle
        if slot is None:  # a kept output: slots after the input's, in the order they are saved
            slot = len(handles) + 1
        handle = _OffloadedTensor(self, (index, slot), tensor)
        handles.append(weakref.ref(handle))
        self.offloaded_last_step += 1
        self.offloaded_bytes_last_step += tensor.numel() * tensor.element_size()
        return handle

    def _unpack(self, packed):
        if not isinstance(packed, _OffloadedTensor):
            return packed
        return packed.unpack()  # copies now unless the output-gradient hook started it


def _aliases(a: torch.Tensor, b: torch.Tensor | None) -> bool:
    return b is not None and a.device == b.device and torch._C._is_alias_of(a, b)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Storage identity rather than data_ptr(): fake tensors (the memory estimate) have none.
    return (a.device == b.device and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            and a.storage_offset() == b.storage_offset() and torch._C._is_alias_of(a, b))
