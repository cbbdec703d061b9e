"""The memory the tiled MLP and the chunked loss exist to save, measured with fake tensors
and MemTracker on their real loops (the same functions the custom ops run): the peak beyond
inputs and outputs is one tile / one chunk's worth, whatever the sequence length."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

from upipe_compile.stack.chunked_loss import linear_cross_entropy_backward, linear_cross_entropy_forward
from upipe_compile.measure.memory import tracker_peak_bytes

MIB = 1 << 20


def peak_beyond_start(fn, *tensors) -> int:
    tracker = MemTracker()
    tracker.track_external(*tensors)
    with tracker:
        start = tracker_peak_bytes(tracker)
        fn()
    return tracker_peak_bytes(tracker) - start


def mlp_backward_peak(tokens, tile, dim=256, hidden=2048):
    from upipe_compile.stack.tiled_mlp import tiled_swiglu_backward

    with FakeTensorMode():
        x, grad = torch.empty(tokens, dim), torch.empty(tokens, dim)
        w1, w2, w3 = torch.empty(hidden, dim), torch.empty(dim, hidden), torch.empty(hidden, dim)
        # dx and the three weight gradients are outputs; what is left is per tile.
        outputs = tokens * dim * 4 + 3 * hidden * dim * 4
        return peak_beyond_start(lambda: tiled_swiglu_backward(grad, x, w1, w2, w3, tile), x, grad, w1, w2, w3) \
            - outputs


def loss_backward_peak(tokens, chunk, dim=256, vocab=32000):
    with FakeTensorMode():
        hidden, weight = torch.empty(tokens, dim), torch.empty(vocab, dim)
        labels, lse, grad = torch.zeros(tokens, dtype=torch.long), torch.empty(tokens), torch.ones(())
        fn = lambda: linear_cross_entropy_backward(grad, hidden, weight, labels, lse, chunk, -100)  # noqa: E731
        return peak_beyond_start(fn, hidden, weight, labels, lse, grad)


def test_tiled_mlp_backward_peak_is_per_tile():
    short, long = mlp_backward_peak(8192, 1024), mlp_backward_peak(65536, 1024)
    untiled = mlp_backward_peak(65536, 65536)
    assert long == short  # 8x the tokens, the same intermediate peak
    assert long <= 7 * 1024 * 2048 * 4  # measured: 7 [tile, hidden] fp32 tensors at the peak
    assert untiled >= 40 * long  # the whole sequence at once (64x the tokens of one tile)


def test_chunked_loss_peak_is_per_chunk():
    short, long = loss_backward_peak(8192, 512), loss_backward_peak(65536, 512)
    chunk_logits = 512 * 32000 * 4
    outputs = 65536 * 256 * 4 + 32000 * 256 * 4  # grad hidden, grad weight (fp32: no cast)
    assert long - outputs <= 2 * chunk_logits  # chunk-sized fp32 tensors beyond the outputs
    assert long - short == (65536 - 8192) * 256 * 4  # grows only by the longer grad_hidden output
    with FakeTensorMode():
        forward = peak_beyond_start(
            lambda: linear_cross_entropy_forward(torch.empty(65536, 256), torch.empty(32000, 256),
                                                 torch.zeros(65536, dtype=torch.long), 512, -100))
    assert forward < 4 * chunk_logits + 65536 * 4 * 2  # never [65536, 32000] (8 GiB)
