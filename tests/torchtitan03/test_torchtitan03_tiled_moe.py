"""A torchtitan 0.3 MoE layer with its tokens in tiles (upipe_compile.stack.tiled_moe) equals
the layer run on the whole sequence: the output, the input's gradient and every parameter's,
under full activation checkpointing as the 0.3 path runs it (each tile's checkpoint nested in
the block's), with hypothesis drawing the batch, the length and the tile. The layer keeps its
parameters, buffers and state-dict keys, and pickles whole. Runs in the torchtitan 0.3 tier."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.utils.checkpoint import checkpoint

import tt03_jobs as jobs
from tests_support import relative_error
from upipe_compile.stack.tiled_moe import moe_tiling_problem, tile_moe_tokens


def moe_layer(seed: int = 0):
    """The Qwen3 MoE debug model's layer with 8 experts, 2 a token, in fp32, its load-balancing
    bias set (it changes which experts a token picks)."""
    from torchtitan.models.qwen3 import model_registry

    config = next(layer.moe for layer in model_registry("debugmodel_moe").model.layers if layer.moe is not None)
    torch.manual_seed(seed)
    layer = jobs.fewer_experts(config).build()
    layer.init_states(buffer_device=None)
    with torch.no_grad():
        layer.expert_bias_E.normal_(std=0.01)
    return layer


def run(layer, x, checkpointed: bool):
    x = x.detach().requires_grad_()
    out = checkpoint(layer, x, use_reentrant=False) if checkpointed else layer(x)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
    return out.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}


@pytest.fixture(autouse=True)
def experts_in_fp32():
    """0.3 computes the experts in bf16, where a sum over another set of tokens rounds
    differently: fp32 here, so that every difference is the tiling's."""
    from unittest import mock

    from torchtitan.models.common.moe import GroupedExperts

    with mock.patch.object(GroupedExperts, "forward", jobs.experts_in_fp32):
        yield


@settings(max_examples=12, deadline=None)
@given(batch=st.integers(1, 2), seq=st.integers(1, 96), tile=st.integers(1, 64), checkpointed=st.booleans())
def test_tiles_equal_the_whole_layer(batch, seq, tile, checkpointed):
    whole = moe_layer()
    tiled = copy.deepcopy(whole)
    tile_moe_tokens(tiled, tile, block_recomputed=checkpointed)
    x = torch.randn(batch, seq, whole.router.gate.in_features, generator=torch.Generator().manual_seed(seq))
    with torch.autocast("cpu", enabled=False):
        (out, dx, grads), (t_out, t_dx, t_grads) = run(whole, x, checkpointed), run(tiled, x, checkpointed)
    # one token's arithmetic is the same either way; only sums over tokens (the weights'
    # gradients) and the matmuls' blocking change order: fp32's few ulps
    assert relative_error(t_out, out) <= 1e-5 and relative_error(t_dx, dx) <= 1e-5
    assert t_grads.keys() == grads.keys()
    for name, grad in grads.items():
        if grad is not None:
            assert relative_error(t_grads[name], grad) <= 1e-5, name
    # the counts the bias update reads: the untiled layer's (with the block recomputed, twice)
    assert torch.equal(tiled.tokens_per_expert_E, whole.tokens_per_expert_E)


def test_the_layer_keeps_its_parameters_and_state_dict_keys():
    layer = moe_layer()
    before = {name: p for name, p in layer.named_parameters()}
    keys = list(layer.state_dict())
    tile_moe_tokens(layer, 16, block_recomputed=True)
    assert dict(layer.named_parameters()) == before and list(layer.state_dict()) == keys
    assert isinstance(layer, type(moe_layer())) and type(layer).__name__ == "TokenTiledMoE"


def test_a_tiled_layer_pickles_whole():
    """torch.save of the whole module (not only its state dict) rebuilds it tiled."""
    layer = moe_layer()
    tile_moe_tokens(layer, 16, block_recomputed=True)
    copy_of = pickle.loads(pickle.dumps(layer))
    assert type(copy_of) is type(layer) and copy_of.upipe_tile_tokens == 16 and copy_of.upipe_block_recomputed
    x = torch.randn(2, 40, layer.router.gate.in_features, generator=torch.Generator().manual_seed(3))
    with torch.autocast("cpu", enabled=False):
        assert torch.equal(copy_of(x), layer(x))


def test_what_is_not_a_known_moe_layer_is_refused():
    class Routed(torch.nn.Module):
        def forward(self, x):
            return x

    assert "is not a known token-choice MoE layer" in moe_tiling_problem(Routed())
    with pytest.raises(ValueError, match="cannot tile this MoE layer: Routed"):
        tile_moe_tokens(Routed(), 16, block_recomputed=True)
    with pytest.raises(ValueError, match="tile_tokens must be a positive int"):
        tile_moe_tokens(moe_layer(), 0, block_recomputed=True)
