"""Rank-side jobs for tests/test_torchtitan.py: torchtitan 0.2.2's Llama3 debug model trained
through the upipe integration at the model level.

The job follows torchtitan's Trainer step by step, with torchtitan's own functions wherever
the Trainer uses them: ConfigManager (TOML + custom config module), experimental.custom_import,
ParallelDims and its meshes, get_train_spec (-> the spec registered by the integration),
meta-device build, parallelize_fn, init_weights, build_optimizers_fn / build_lr_schedulers_fn,
build_loss_fn, prepare_context_parallel_input (with the job's load balancer), loss scaling by
the global token count, clip_grad_norm_, dist_sum over the "loss" mesh. What it replaces:
the dataloader (seeded random tokens; the c4_test/tokenizer assets are not in the wheel) and
the device (CPU).
"""

from __future__ import annotations

import importlib
import os
from types import SimpleNamespace

import torch
import torch.distributed as dist

from tests_support import attention_events, full_tensor, load_full_weights, wrapped_name
from upipe_compile.integrations.torchtitan.estimate_job import torchtitan_on_cpu
from upipe_compile.integrations.torchtitan.release_022.estimate import load_config as load_toml

HERE = os.path.dirname(os.path.abspath(__file__))
DEBUG_TOML = os.path.join(HERE, "..", "integrations", "torchtitan", "debug_model_upipe_cpu.toml")


def load_config(toml: str, *overrides: str):
    return load_toml(toml, list(overrides))


# The long-context stack, all on: full AC (offload needs it), uneven MLP tiles and loss chunks
# on both CP degrees (128 or 256 local tokens per rank).
STACK_OVERRIDES = (
    "--activation_checkpoint.mode=full", "--upipe.offload_block_inputs",
    "--upipe.mlp_tile_tokens=48", "--upipe.loss_chunk_tokens=40",
    "--upipe.host_memory_reserve_gib=1",  # this machine's RAM is small; the inputs are not
)


EOS_ID = 0


def global_batch(job_config, step: int, vocab: int, documents: bool = False):
    """The same full-sequence batch on every rank: (inputs, labels) [B, S]; a few labels are
    torchtitan's IGNORE_INDEX (as padding gives), so the loss's ignore path is exercised.
    With ``documents``, EOS tokens (and no other zeros) end documents of random lengths, one
    crossing the middle (the CP=2 shard boundary), one of length 1."""
    from torchtitan.components.loss import IGNORE_INDEX

    gen = torch.Generator().manual_seed(1000 + step)
    b, s = job_config.training.local_batch_size, job_config.training.seq_len
    tokens = torch.randint(1 if documents else 0, vocab, (b, s + 1), generator=gen)
    if documents:
        ends = torch.randperm(s - 1, generator=gen)[:6].tolist() + [3, 4]
        tokens[:, [e for e in ends if abs(e - s // 2) > 2]] = EOS_ID
    labels = tokens[:, 1:].clone()
    labels[torch.rand(b, s, generator=gen) < 0.1] = IGNORE_INDEX
    return tokens[:, :-1].contiguous(), labels




def train_debug_model(cp: int, steps: int, n_layers: int | None = None, overrides: tuple[str, ...] = (),
                      model_changes: dict | None = None, documents: bool = False):
    """Train the debug model for ``steps`` steps with context-parallel degree ``cp`` on all
    ranks of the current (gloo) world, the debug TOML changed by ``overrides`` (torchtitan
    command-line style) and the flavor's model args by ``model_changes``. Returns (losses, first-step grads by parameter name, first-step local
    positions (None under upipe's sharding), the RoPE table the model read in step 1 and the
    full-sequence one, upipe op counts of the last step, load balancer seen, what the offloader moved
    in each step). ``documents``: the varlen flavor on one packed row of EOS-separated
    documents, its boundaries made by the model's get_attention_masks on the full batch (as
    the Trainer does) and passed whole to every rank (cp_layout.shard_batch)."""
    from torchtitan.components.loss import IGNORE_INDEX
    from torchtitan.distributed import ParallelDims, utils as dist_utils
    from torchtitan.protocols.train_spec import get_train_spec

    from upipe_compile.integrations.torchtitan.release_022.rope_rows import rope_buffer_name

    torchtitan_on_cpu()
    torch._dynamo.reset()
    world = dist.get_world_size()
    packed = ["--model.flavor=debugmodel_varlen_attn", "--training.local_batch_size=1"] if documents else []
    job_config = load_config(DEBUG_TOML, f"--parallelism.context_parallel_degree={cp}",
                             f"--training.steps={steps}", *overrides, *packed)
    importlib.import_module(job_config.experimental.custom_import)  # as Trainer.__init__ does
    p = job_config.parallelism
    parallel_dims = ParallelDims(
        dp_shard=p.data_parallel_shard_degree, dp_replicate=p.data_parallel_replicate_degree,
        cp=p.context_parallel_degree, tp=p.tensor_parallel_degree, pp=p.pipeline_parallel_degree,
        ep=p.expert_parallel_degree, etp=p.expert_tensor_parallel_degree, world_size=world,
    )
    parallel_dims.build_mesh()
    train_spec = get_train_spec(job_config.model.name)
    model_args = train_spec.model_args[job_config.model.flavor]
    model_args.update_from_config(job_config)
    changes = dict(model_changes or {}, **({"n_layers": n_layers} if n_layers is not None else {}))
    if changes:
        import dataclasses
        model_args = dataclasses.replace(model_args, **changes)

    # Reference weights: one seeded full model, identical for every CP degree.
    torch.manual_seed(0)
    reference = train_spec.model_cls(model_args)
    with torch.no_grad():
        reference.init_weights()
    full_state = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    rope_name = rope_buffer_name(reference)
    full_rope = getattr(reference, rope_name).detach().clone()
    del reference

    with torch.device("meta"):
        model = train_spec.model_cls(model_args)
    model = train_spec.parallelize_fn(model, parallel_dims, job_config)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    load_full_weights(model, full_state)
    model.train()

    optimizers = train_spec.build_optimizers_fn([model], job_config.optimizer, parallel_dims)
    lr_schedulers = train_spec.build_lr_schedulers_fn(optimizers, job_config.lr_scheduler, steps)
    loss_fn = train_spec.build_loss_fn(job_config, parallel_dims=parallel_dims)

    losses, first_grads, first_positions, counts, offloaded, document_counts = [], None, None, None, [], []
    first_rope = None
    offloader = getattr(model, "upipe_offloader", None)
    for step in range(1, steps + 1):
        optimizers.zero_grad()
        inputs, labels = global_batch(job_config, step, model_args.vocab_size, documents)
        global_valid_tokens = (labels != IGNORE_INDEX).sum().float()  # dp degree 1
        extra_kwargs = {}
        if documents:
            import torchtitan.train

            masks = model.get_attention_masks(input_batch=inputs, tokenizer=SimpleNamespace(eos_id=EOS_ID))
            document_counts.append(masks.cu_seq_q.numel() - 1)
            extra_kwargs["attention_masks"] = masks
            if parallel_dims.cp_enabled:  # the function the Trainer calls (routed by the integration)
                inputs, labels, extra_kwargs = torchtitan.train.prepare_context_parallel_input(
                    inputs, labels, extra_kwargs, parallel_dims.get_mesh("cp"), torch.device("cpu"),
                    job_config.parallelism.context_parallel_load_balancer,
                )
        elif parallel_dims.cp_enabled:  # the function the Trainer calls (routed by the integration)
            import torchtitan.train

            inputs, labels, extra_kwargs = torchtitan.train.prepare_context_parallel_input(
                inputs, labels, extra_kwargs, parallel_dims.get_mesh("cp"), torch.device("cpu"),
                job_config.parallelism.context_parallel_load_balancer,
            )
        profile = step == steps
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if profile else None
        if prof:
            prof.__enter__()
        pred = model(inputs, **extra_kwargs)
        pred_type = type(pred).__name__
        loss = loss_fn(pred, labels) / global_valid_tokens
        del pred
        loss.backward()
        if prof:
            prof.__exit__(None, None, None)
            counts = dict(attention_events(prof))
        if offloader is not None:
            offloaded.append((offloader.offloaded_last_step, offloader.offloaded_bytes_last_step))
        if step == 1:
            first_grads = {wrapped_name(n): full_tensor(p.grad).detach().clone() for n, p in model.named_parameters()}
            first_positions = extra_kwargs.get("positions")
            first_rope = getattr(model, rope_name).detach().clone()
        dist_utils.clip_grad_norm_(list(model.parameters()), job_config.training.max_norm, foreach=True)
        optimizers.step()
        lr_schedulers.step()
        loss = loss.detach()
        if parallel_dims.dp_cp_enabled:
            loss = dist_utils.dist_sum(loss, parallel_dims.get_mesh("loss"))
        losses.append(float(loss))
    return {
        "losses": losses, "grads": first_grads, "positions": first_positions, "counts": counts,
        "rope_table": first_rope, "full_rope_table": full_rope,
        "load_balancer": job_config.parallelism.context_parallel_load_balancer,
        "n_layers": model_args.n_layers, "offloaded": offloaded, "pred_type": pred_type, "documents": document_counts,
        "local_tokens": inputs.numel(), "seq_local": inputs.shape[1], "dim": model_args.dim,
        # what the offload's arithmetic reads (model_args' own class may be made at run time: not picklable)
        "model_dims": SimpleNamespace(n_layers=model_args.n_layers, dim=model_args.dim, n_heads=model_args.n_heads,
                                      n_kv_heads=model_args.n_kv_heads),
    }


def rope_rows_across_lengths():
    """rope_rows' hook on a toy model whose RoPE table row i holds i: the rows each forward
    read, for steps of 8, 4 and again 8 tokens per rank over this world's 1-D mesh, and what a
    step with positions and one longer than the table raise."""
    from torch.distributed.device_mesh import init_device_mesh

    from upipe_compile.integrations.torchtitan.release_022.rope_rows import keep_local_rope_rows

    class Toy(torch.nn.Module):
        max_seq_len = 32

        def __init__(self):
            super().__init__()
            self.register_buffer("freqs_cis", self._precompute_freqs_cis(), persistent=False)

        def _precompute_freqs_cis(self):
            return torch.arange(self.max_seq_len, dtype=torch.float32)

        def forward(self, tokens, positions=None):
            return self.freqs_cis[: tokens.shape[1]].clone()

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    model = Toy()
    keep_local_rope_rows(model, mesh)
    read = [model(torch.zeros(1, n)).tolist() for n in (8, 4, 8)]
    errors = []
    for call in (lambda: model(torch.zeros(1, 8), positions=torch.zeros(1, 8)), lambda: model(torch.zeros(1, 32))):
        try:
            call()
            errors.append(None)
        except Exception as error:  # noqa: BLE001  (the test reads the message)
            errors.append(str(error))
    return read, errors
