"""torchtitan 0.3's Llama3 debug model with its varlen attention (``varlen_attn`` over the
documents of one packed row, fused ``wqkv``, complex RoPE at the documents' positions), for
the 0.3 tier (scripts/test_torchtitan03.sh). Module-level for spawned ranks."""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist

import upipe_compile
from tests_support import attention_events, full_tensor, load_full_weights, wrapped_name

LAYERS = 2
LENGTHS = (7, 1, 30, 26)  # 64 tokens: a document of one token, documents crossing the shards of 2 and 4 ranks
VOCAB = 2048


def build(attn_backend: str = "varlen", window=None, kv_heads=None):
    """The debug model (two layers; ``kv_heads``: GQA, its fused wqkv laid out per KV group as
    Llama3-8B's), seeded: identical on every process."""
    from torchtitan.models.llama3 import _build_llama3_layers, compute_ffn_hidden_dim, model_registry

    config = model_registry("debugmodel", attn_backend=attn_backend).model
    layers = config.layers[:LAYERS]
    if kv_heads is not None:
        attention = layers[0].attention
        layers = _build_llama3_layers(fuse_qkv=True, n_layers=LAYERS, dim=config.dim, n_heads=attention.n_heads,
                                      n_kv_heads=kv_heads, hidden_dim=compute_ffn_hidden_dim(config.dim, multiple_of=256),
                                      rope=attention.rope, attn_backend=attn_backend)
    if window is not None:  # every layer's varlen attention with a sliding window
        for layer in layers:
            layer.attention.inner_attention.window_size = window
    config = dataclasses.replace(config, layers=layers)
    torch.manual_seed(0)
    model = config.build()
    model.init_states(buffer_device=None)
    return model.float().train()


def inputs():
    gen = torch.Generator().manual_seed(1)
    seq = sum(LENGTHS)
    tokens = torch.randint(0, VOCAB, (1, seq), generator=gen)
    positions = torch.cat([torch.arange(n) for n in LENGTHS]).unsqueeze(0)
    dout = torch.randn(1, seq, VOCAB, generator=gen)
    return tokens, positions, dout


def _grads(model):
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def varlen_on_cpu(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                  enable_gqa=False, return_aux=None, num_splits=None, **unused):
    """varlen_attn's meaning on one CPU process (its flash kernel is CUDA-only): attention
    within each document of ``cu_seq_q``, through upipe's single-process document attention."""
    assert cu_seq_k is cu_seq_q and return_aux is None and not unused
    left, right = window_size
    causal = right == 0
    out = upipe_compile.document_sdpa(q.unsqueeze(0).transpose(1, 2), k.unsqueeze(0).transpose(1, 2),
                                      v.unsqueeze(0).transpose(1, 2), cu_seq_q, is_causal=causal, scale=scale,
                                      window=None if left < 0 and (causal or right < 0) else
                                      ((left, left) if causal else (left, right)),
                                      enable_gqa=enable_gqa)
    return out.transpose(1, 2).squeeze(0)


def experts_in_fp32(self, x_RD, num_tokens_per_expert_E):
    """0.3's GroupedExperts.forward in fp32 (0.3 computes the experts in bf16): each expert's
    SwiGLU over its rows, the rows grouped by expert in order (rows past the counts: zeros)."""
    from torch.distributed.tensor import DTensor

    w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
    counts = num_tokens_per_expert_E.tolist()
    routed = sum(counts)
    outs = [(torch.nn.functional.silu(rows @ w1[e].T) * (rows @ w3[e].T)) @ w2[e].T
            for e, rows in enumerate(x_RD[:routed].split(counts))]
    return torch.cat([*outs, x_RD.new_zeros(x_RD.shape[0] - routed, w2.shape[1])])


MOE_EXPERTS, MOE_TOP_K = 8, 2
"""The MoE debug model's layers with 8 experts, 2 a token, in place of its 64 and 8: the same
router, dispatch and experts' code, at an eighth of the weights (with 64, the fp32 weights,
gradients and Adam state made each rank 2.6-3.1 GB, and the EP test used 23 of a 24 GiB
runner's memory)."""


def fewer_experts(moe):
    """``moe`` (a 0.3 MoE layer's config) with :data:`MOE_EXPERTS` experts, :data:`MOE_TOP_K` a token."""
    replace, routed, router = dataclasses.replace, moe.routed_experts, moe.router
    return replace(
        moe, num_experts=MOE_EXPERTS,
        router=replace(router, num_experts=MOE_EXPERTS, top_k=MOE_TOP_K,
                       gate=replace(router.gate, out_features=MOE_EXPERTS)),
        routed_experts=replace(
            routed, inner_experts=replace(routed.inner_experts, num_experts=MOE_EXPERTS),
            token_dispatcher=replace(routed.token_dispatcher, num_experts=MOE_EXPERTS, top_k=MOE_TOP_K)))


def torch_with_fp32_attention():
    """torch as 0.3's attention module sees it, but for the bf16 its varlen attention casts q,
    k, v to: float32 (a module, which torch.compile reads like torch itself)."""
    import types

    module = types.ModuleType("torch")
    module.__dict__.update(torch.__dict__)
    module.bfloat16 = torch.float32
    return module


def reference(window=None, kv_heads=None, exact: bool = False):
    """CP = 1: the whole row through the eager model (varlen_attn on the CPU as above):
    (logits, param grads). ``exact``: without the attention's cast to bf16 (the model is fp32
    throughout: what both bf16 runs are measured against)."""
    from unittest import mock

    from torchtitan.models.common.attention import create_varlen_metadata_for_document

    model = build(window=window, kv_heads=kv_heads)
    tokens, positions, dout = inputs()
    with contextlib.ExitStack() as patches:
        patches.enter_context(mock.patch("torchtitan.models.common.attention.varlen_attn", varlen_on_cpu))
        if exact:
            patches.enter_context(mock.patch("torchtitan.models.common.attention.torch", torch_with_fp32_attention()))
        logits = model(tokens, positions, create_varlen_metadata_for_document(positions))
    (logits * dout).sum().backward()
    return logits.detach(), _grads(model)


def compiled_case(fuse: bool, window=None, kv_heads=None, ring: int = 1):
    """This rank's shard at CP = P through the model compiled with backend="upipe": the row's
    documents (VarlenMetadata of the whole row), this rank's tokens and positions: (logits
    shard, param grads, upipe op counts). ``ring`` > 1: over a (ring, all-to-all) mesh, in
    its zigzag layout; the logits come back gathered and cut as contiguous shards."""
    from torchtitan.models.common.attention import create_varlen_metadata_for_document

    from upipe_compile.sharding import gather_sequence, shard_sequence

    torch._dynamo.reset()
    world, rank = dist.get_world_size(), dist.get_rank()
    assert world > 1
    mesh, options = None, {"inner_backend": "aot_eager", "fuse_projections": fuse}
    if ring > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (ring, world // ring), mesh_dim_names=("cp_ring", "cp_a2a"))
        options["cp_mesh"] = mesh
    model = build(window=window, kv_heads=kv_heads)
    tokens, positions, dout = inputs()
    masks = create_varlen_metadata_for_document(positions)
    tokens, local_positions, dout = (shard_sequence(t, mesh, dim=1) for t in (tokens, positions, dout))
    compiled = torch.compile(model, backend="upipe", options=options)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        logits = compiled(tokens, local_positions, masks)
        (logits * dout).sum().backward()
    logits = logits.detach()
    if mesh is not None:
        logits = gather_sequence(logits, mesh, dim=1).chunk(world, dim=1)[rank]
    return logits, _grads(model), dict(attention_events(prof))


def flex_refusal():
    """0.3's default (Flex) attention at CP = 2: the refusal's text."""
    torch._dynamo.reset()
    model = build("flex")
    tokens, positions, _ = inputs()
    tokens, local_positions = (upipe_compile.shard_sequence(t, dim=1) for t in (tokens, positions))
    masks = model.get_attention_masks(local_positions)  # a mask over the shard: attention on it alone
    try:  # without gradients: torch's FlexAttention has no CPU backward to trace
        with torch.no_grad():
            torch.compile(model, backend="upipe", options={"inner_backend": "aot_eager"})(tokens, local_positions, masks)
    except Exception as e:  # noqa: BLE001 (the test reads the message)
        return f"{type(e).__name__}: {e}"
    return None


# ---------------------------------------------------------------------------------------------
# Training through the 0.3 config path (--module upipe_compile.integrations.torchtitan)

CONFIG_MODULE = "upipe_compile.integrations.torchtitan"
CPU_CONFIG = "llama3_debugmodel_upipe_cpu"


def load_config(*overrides: str, config: str = CPU_CONFIG):
    """A shipped 0.3 config through torchtitan's ConfigManager, command-line ``overrides``."""
    from upipe_compile.integrations.torchtitan.release_03.estimate import load_config as load_03_config

    return load_03_config(config, list(overrides), module=CONFIG_MODULE)


def training_batch(seq: int, step: int):
    """One packed row as 0.3's dataloader gives it, the same on every rank: tokens, positions
    restarting at each document (random lengths, one of a single token) and labels, a few of
    them IGNORE_INDEX."""
    from torchtitan.components.loss import IGNORE_INDEX

    gen = torch.Generator().manual_seed(100 + step)
    cuts = sorted(set(torch.randint(1, seq, (6,), generator=gen).tolist()) | {seq // 3, seq // 3 + 1})
    lengths = [b - a for a, b in zip([0, *cuts], [*cuts, seq])]
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    tokens = torch.randint(0, VOCAB, (1, seq + 1), generator=gen)
    labels = tokens[:, 1:].clone()
    labels[torch.rand(1, seq, generator=gen) < 0.1] = IGNORE_INDEX
    return {"input": tokens[:, :-1].contiguous(), "positions": positions}, labels


def optimizer_step(model, config, optimizers, lr_schedulers, parallel_dims, loss: torch.Tensor,
                   grad_norms: list | None = None) -> float:
    """The end of 0.3's Trainer step after backward: clip, step the optimizers and the LR
    schedule; the loss as the Trainer logs it (the ranks' sums over the "loss" mesh, which the
    Trainer then requires to be finite). ``grad_norms``: the clipped total norm is appended."""
    from torchtitan.distributed import utils as dist_utils

    norm = dist_utils.clip_grad_norm_(list(model.parameters()), config.training.max_norm, foreach=True,
                                      ep_enabled=parallel_dims.ep_enabled)
    if grad_norms is not None:
        grad_norms.append(float(full_tensor(norm)))
    optimizers.step()
    lr_schedulers.step()
    loss = loss.detach()
    if parallel_dims.dp_cp_enabled:
        loss = dist_utils.dist_sum(loss, parallel_dims.get_optional_mesh("loss"))
    return float(loss)


def train(cp: int, steps: int = 4, overrides: tuple[str, ...] = (), window=None, fp32_attention: bool = True,
          config_name: str = CPU_CONFIG, nan_at: tuple[int, int] | None = None, biases: bool = False):
    """:func:`train_job`, with fp32 experts from the start when ``fp32_attention``: EP's
    parallelize captures the experts' forward in its local_map."""
    from unittest import mock

    from torchtitan.models.common.moe import GroupedExperts

    with contextlib.ExitStack() as patches:
        if fp32_attention:
            patches.enter_context(mock.patch.object(GroupedExperts, "forward", experts_in_fp32))
        return train_job(cp, steps, overrides, window, fp32_attention, config_name, nan_at, biases)


def train_job(cp: int, steps: int = 4, overrides: tuple[str, ...] = (), window=None, fp32_attention: bool = True,
              config_name: str = CPU_CONFIG, nan_at: tuple[int, int] | None = None, biases: bool = False):
    """Train the CPU debug config for ``steps`` steps at CP = ``cp`` on every rank of the gloo
    world, following 0.3's Trainer: ConfigManager, UPipeTrainer's take-over of the job,
    ParallelDims and its meshes, meta build, the ModelSpec's parallelize_fn, init_weights,
    the config's loss (ChunkedLossWrapper), optimizer and scheduler, UPipeTrainer's
    post_dataloading_process, clip_grad_norm_, the loss summed over the "loss" mesh. What it
    replaces: the dataloader (seeded packed rows), the device (CPU), and at CP = 1 the varlen
    kernel (CUDA only) by its meaning (varlen_on_cpu). Two layers; every rank starts from one
    seeded full model. ``fp32_attention``: without 0.3's casts to bf16 (of q, k, v, and
    of the experts' inputs and weights in a MoE model: experts_in_fp32), so that the model is
    fp32 and every difference is upipe's, not bf16 rounding's. Returns (losses, first-step gradients by name, upipe op counts of the
    last step). ``nan_at`` = (rank, step): that rank's final norm outputs NaN at that step
    (after the last attention: in the forward only its own loss term sees the NaN), and the result gains each step's gradient norm. ``biases``: returns (losses, each step's
    MoE load-balancing biases by buffer name, as the optimizer hook left them)."""
    from types import SimpleNamespace
    from unittest import mock

    from torchtitan.components.loss import IGNORE_INDEX
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    from upipe_compile.integrations.torchtitan.estimate_job import torchtitan_on_cpu
    from upipe_compile.integrations.torchtitan.release_03.trainer import UPipeTrainer, take_over

    torchtitan_on_cpu()
    torch._dynamo.reset()
    config = load_config(f"--parallelism.context_parallel_degree={cp}", f"--training.steps={steps}", *overrides,
                         config=config_name)
    model_config = config.model_spec.model
    model_config.layers = model_config.layers[:LAYERS]
    for layer in model_config.layers:
        if getattr(layer, "moe", None) is not None:
            layer.moe = fewer_experts(layer.moe)
    if window is not None:
        for layer in model_config.layers:
            layer.attention.inner_attention.window_size = window
    upipe_on = take_over(config)
    model_config = config.model_spec.model
    parallel_dims = ParallelDims.from_config(config.parallelism, dist.get_world_size())
    parallel_dims.build_mesh()
    dist_utils.set_spmd_backend(config.parallelism.spmd_backend)  # as the Trainer does (TP's loss reads it)
    model_config.update_from_config(config=config)

    torch.manual_seed(0)
    reference = model_config.build()
    reference.init_states(buffer_device=None)
    full_state = {k: v.detach().clone() for k, v in reference.named_parameters()}  # (its state_dict splits wqkv)
    del reference

    with torch.device("meta"):
        model = model_config.build()
    model = config.model_spec.parallelize_fn(
        model, parallel_dims=parallel_dims, training=config.training, parallelism=config.parallelism,
        compile_config=config.compile, ac_config=config.activation_checkpoint, dump_folder=config.dump_folder)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    load_full_weights(model, full_state)
    model.train()
    loss_fn = config.loss.build(compile_config=config.compile)
    loss_fn.set_lm_head(model.lm_head)
    model._skip_lm_head = True
    optimizers = config.optimizer.build(model_parts=[model])
    if config.model_spec.post_optimizer_build_fn is not None:  # the MoE load-balancing hook, as the Trainer
        config.model_spec.post_optimizer_build_fn(optimizers, [model], parallel_dims)
    lr_schedulers = config.lr_scheduler.build(optimizers=optimizers, training_steps=steps)
    trainer = SimpleNamespace(config=config, parallel_dims=parallel_dims, model_parts=[model], ntokens_seen=0,
                              upipe_on=upipe_on)

    losses, first_grads, counts, grad_norms, step_biases = [], None, None, [], []
    current = {"step": 0}
    if nan_at is not None and dist.get_rank() == nan_at[0]:
        def poison(module, args, output):
            if current["step"] != nan_at[1]:
                return output
            return output + float("nan")  # (still a function of the norm's weight: FSDP reduces its gradient)

        model.norm.register_forward_hook(poison)
    with contextlib.ExitStack() as patches:
        if cp == 1:
            patches.enter_context(mock.patch("torchtitan.models.common.attention.varlen_attn", varlen_on_cpu))
        if fp32_attention:
            patches.enter_context(mock.patch("torchtitan.models.common.attention.torch", torch_with_fp32_attention()))
        for step in range(1, steps + 1):
            current["step"] = step
            optimizers.zero_grad()
            input_dict, labels = training_batch(config.training.seq_len, step)
            global_valid_tokens = (labels != IGNORE_INDEX).sum()
            if parallel_dims.dp_enabled:  # as the Trainer: the data shards' tokens together
                global_valid_tokens = dist_utils.dist_sum_tensor(global_valid_tokens,
                                                                 parallel_dims.get_mesh("batch"))
            inputs, labels, extra = UPipeTrainer.post_dataloading_process(trainer, input_dict, labels)
            # The last step's op counts; a profiler session per step only adds sessions that
            # start and stop while gloo's threads run collectives.
            with (torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if step == steps
                  else contextlib.nullcontext()) as prof:
                pred = model(inputs, **extra)
                loss, _ = loss_fn(pred, labels, global_valid_tokens, positions=extra["positions"])
                del pred
                loss.backward()
            if prof is not None:
                counts = dict(attention_events(prof))
            if step == 1:
                first_grads = {wrapped_name(n): full_tensor(p.grad).detach().clone() for n, p in model.named_parameters()}
            losses.append(optimizer_step(model, config, optimizers, lr_schedulers, parallel_dims, loss, grad_norms))
            step_biases.append({name: full_tensor(buffer).clone() for name, buffer in model.named_buffers()
                                if name.endswith("expert_bias_E")})
    if nan_at is not None:
        return losses, grad_norms
    if biases:
        return losses, step_biases
    return losses, first_grads, counts
