"""The whole-step memory estimate of a transformers causal LM trained as ``UPipeTrainer`` trains
it: ``python -m upipe_compile.estimate --hf CONFIG --seq-len N --cp P`` (entry point ``hf`` in
the group ``upipe_compile.estimate_jobs``: :func:`command`). The job is built here; the
measuring and the report are upipe_compile.estimate's.

The job, built as the Trainer path builds it, on fake CPU tensors over a fake process group of
P x K ranks (K data-parallel groups of P context-parallel ranks):

- the model from its config on the meta device, ``attn_implementation="upipe"`` (register());
- the stack pieces asked for (:func:`upipe_compile.integrations.hf_stack.apply_stack`, its own
  checks and refusals), the offloader's host copies on "meta" (the tracker's host);
- gradient checkpointing as ``TrainingArguments(gradient_checkpointing=True)`` sets it
  (non-reentrant, every decoder layer);
- attention: each layer's ``self_attn`` compiled with
  :func:`upipe_compile.measure.eager_twins.eager_twin_backend` over the CP mesh (the upipe
  passes and options, then the ops' eager twins running the real stage loops), where the
  Trainer compiles the backbone with ``backend="upipe"``;
- FSDP2 as accelerate prepares it with ``mixed_precision="bf16"``: ``fully_shard`` on every
  decoder layer then the root over all P x K ranks, fp32 master parameters,
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16, output_dtype=bf16)`` (accelerate's
  default policy), ``reshard_after_forward=True``; AdamW (``adamw_torch_fused``, the Trainer's
  default) with its state already present.

Then one step under upipe_compile.estimate.step's tracker: rank 0's shard of one row of N tokens
(:func:`upipe_compile.integrations.hf_batch.upipe_batch`: global positions, shifted labels),
forward with the model's own loss over ``num_items_in_batch`` (the Trainer's), backward,
gradient clipping (``max_grad_norm=1``), the optimizer step. The report is the torchtitan
estimate's (upipe_compile.estimate.report's ``result_of``): budget, device ratio, host memory
per node.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import torch

from upipe_compile.errors import display_path
from upipe_compile.attention.kernels import DEFAULT_CUDA_KERNEL
from upipe_compile.estimate.cli_format import format_report, max_context_output
from upipe_compile.estimate.errors import JobError
from upipe_compile.estimate.fake_sharding import private_sharding_fake_mode
from upipe_compile.estimate.gpu import CUBLAS_WORKSPACES_GIB, DEVICE_RATIO, GIB
from upipe_compile.estimate.plain_loops import FusedRMSNormFunction, plain_stack_loops
from upipe_compile.estimate.report import H100_80GB_GIB, Estimate, result_of, step_time_report
from upipe_compile.estimate.search import search
from upipe_compile.estimate.step import (DEVICE, HOST, PhaseTracker, SavedOnDevice, kernel_models, measured,
                                         offload_staging_bytes)
from upipe_compile.estimate.step_time import ModelShape, Setup
from upipe_compile.integrations.hf_stack import StackSettings, apply_stack, decoder_layers
from upipe_compile.measure import workspace
from upipe_compile.measure.memory import counting_eager_calls
from upipe_compile.sharding import sequence_multiple
from upipe_compile.stack.host_memory import HOST_BUDGET_GIB

FSDP_POLICY = "fp32 master weights, bf16 params / bf16 reduce (accelerate's FSDP2 default policy)"

CONFIGS = Path(__file__).with_name("hf_configs")
"""Shipped configs: public hyperparameters of a few models, by name."""


def shipped_configs() -> list[str]:
    return sorted(p.stem for p in CONFIGS.glob("*.json"))


@dataclass(frozen=True)
class HFJob:
    """One transformers training job: the model's config and UPipeTrainer's arguments."""

    config: str
    """A config.json, a model folder holding one, or a shipped config's name."""
    seq_len: int
    cp: int
    nodes: int = 1
    """K data-parallel groups of ``cp`` ranks; FSDP shards over all ``cp x nodes``."""
    ring_degree: int = 1
    """R > 1: the ``cp`` ranks as a ring of R groups of ``cp / R`` (UPipeTrainer's ``ring_degree``:
    all-to-all within a group, ring attention between groups, the row laid out zigzag)."""
    heads_per_stage: int | None = None
    loss_chunk_tokens: int = 0
    mlp_tile_tokens: int = 0
    offload_block_inputs: bool = False
    keep_attention: bool = False
    gradient_checkpointing: bool = True
    fsdp_cpu_offload: bool = False
    """FSDP2 keeps the parameters, gradients and optimizer state on the host
    (``TrainingArguments(fsdp="full_shard offload")``: accelerate's CPUOffloadPolicy)."""

    @property
    def world(self) -> int:
        return self.cp * self.nodes

    @property
    def a2a(self) -> int:
        """The all-to-all ranks of a ring group; U is counted over them."""
        return self.cp // self.ring_degree if self.ring_degree >= 1 and self.cp % self.ring_degree == 0 else self.cp

    def as_json(self) -> dict:
        # the config named from its package (a shipped one) or the working directory, not the machine's folders
        return {**asdict(self), "config_file": display_path(str(config_path(self.config))), "world_size": self.world,
                "fsdp": FSDP_POLICY}

    def describe(self) -> str:
        stack = [f"{k} = {getattr(self, k)}" for k in ("loss_chunk_tokens", "mlp_tile_tokens") if getattr(self, k)]
        stack += [k for k in ("offload_block_inputs", "keep_attention") if getattr(self, k)]
        fsdp = f"{FSDP_POLICY}, state offloaded to the host" if self.fsdp_cpu_offload else FSDP_POLICY
        ring = "" if self.ring_degree == 1 else f" (ring {self.ring_degree} x all-to-all {self.a2a})"
        return (f"transformers model {self.config} ({config_path(self.config)}) as UPipeTrainer trains it: "
                f"{self.nodes} x {self.cp}{ring} ranks, FSDP2 over all ({fsdp}), gradient checkpointing "
                f"{'on (non-reentrant)' if self.gradient_checkpointing else 'off'}, stack: "
                f"{', '.join(stack) or 'none'}")

    def problems(self) -> list[str]:
        out = []
        for key in ("seq_len", "cp", "nodes", "ring_degree"):
            if getattr(self, key) < 1:
                out.append(f"--{key.replace('_', '-')} must be >= 1, got {getattr(self, key)}")
        if out:
            return out
        if self.cp % self.ring_degree:
            return [f"--ring-degree {self.ring_degree} must divide --cp {self.cp}"]
        multiple = sequence_multiple(self.cp, self.ring_degree)
        if self.seq_len % multiple:
            out.append(f"--seq-len {self.seq_len} is not divisible by {multiple}: the Trainer pads every row to a "
                       f"multiple of P{' x 2 (zigzag)' if self.ring_degree > 1 else ''} (pad_to_multiple_of="
                       f"{multiple}); give such a length")
        if self.world < 2:
            out.append("--cp x --nodes must be > 1: the estimate measures FSDP over several ranks")
        if self.heads_per_stage is not None and (self.heads_per_stage < 1 or self.heads_per_stage % self.a2a):
            out.append(f"--heads-per-stage {self.heads_per_stage} must be a positive multiple of the all-to-all "
                       f"ranks ({self.a2a} = --cp / --ring-degree)")
        if self.offload_block_inputs and not self.gradient_checkpointing:
            out.append("--offload-block-inputs needs gradient checkpointing (without it a layer saves much more "
                       "than its input)")
        if self.keep_attention and not self.gradient_checkpointing:
            out.append("--keep-attention needs gradient checkpointing (without a recompute attention runs once anyway)")
        return out


def config_path(spec: str) -> Path:
    """The config.json that ``spec`` names."""
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise JobError(f"--hf {spec}: the folder has no config.json")
        return path
    if path.is_file():
        return path
    shipped = CONFIGS / f"{spec.lower()}.json"
    if shipped.is_file():
        return shipped
    raise JobError(f"--hf {spec!r} is not a config.json, a model folder or a shipped config; shipped: "
                   f"{', '.join(shipped_configs())}")


def load_config(spec: str):
    """The transformers config of ``spec`` (read locally, nothing downloaded)."""
    from transformers import AutoConfig

    path = config_path(spec)
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise JobError(f"--hf {spec}: cannot read {path}: {error}") from None
    raw = {k: v for k, v in raw.items() if not k.startswith("_")}  # our notes (_source)
    model_type = raw.pop("model_type", None)
    try:
        return AutoConfig.for_model(model_type, **raw)
    except (ValueError, KeyError, TypeError) as error:
        raise JobError(f"--hf {spec}: {path} is not a config transformers knows (model_type={model_type!r}): "
                       f"{error}") from None


def build_model(config):
    """The causal LM on the meta device with upipe's attention, fp32 (accelerate's FSDP2 master
    weights under bf16 mixed precision)."""
    from transformers import AutoModelForCausalLM

    from upipe_compile.integrations.transformers import register

    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(config, attn_implementation=register(), dtype=torch.float32)
        except ValueError as error:  # not a causal LM transformers knows
            raise JobError(f"transformers cannot build a causal LM from this config: {error}") from None
    if decoder_layers(model) is None:
        raise JobError(f"{type(model).__name__} has no decoder-layer list (model.model.layers): the estimate shards "
                       "and checkpoints per decoder layer")
    return model


def _trainer_arguments(job: HFJob):
    """What apply_stack reads of TrainingArguments."""
    return SimpleNamespace(gradient_checkpointing=job.gradient_checkpointing,
                           gradient_checkpointing_kwargs={"use_reentrant": False})


@contextlib.contextmanager
def _fused_hf_rms_norms(model):
    """transformers' RMSNorm modules allocate what the fused GPU kernel does, as the torchtitan
    estimate counts RMSNorm (plain_loops.fused_rms_norm): their eager forward makes fp32
    copies the compiled step fuses away. Only modules whose forward is the plain RMSNorm
    (a weight, ``variance_epsilon``); inside a compiled region the real forward is traced."""
    from torch._subclasses.fake_tensor import is_fake

    patched = []
    for module in model.modules():
        name = type(module).__name__
        if not name.endswith("RMSNorm") or not hasattr(module, "variance_epsilon") or "Gemma" in name:
            continue  # Gemma's (1 + weight) and others' variants: counted as eager runs them
        original = module.forward

        def forward(x, _original=original, _module=module):
            if torch.compiler.is_compiling() or not is_fake(x):
                return _original(x)
            return FusedRMSNormFunction.apply(x, 1, _module.weight)

        module.forward = forward
        patched.append(module)
    try:
        yield
    finally:
        for module in patched:
            del module.forward


def _route_attention(model, options: dict) -> None:
    """Each layer's attention compiled with the eager-twin backend (the upipe passes with the
    Trainer's options, the stage loops run for real); inside the checkpointed layer, so AC's
    recompute runs it too. One compiled function object per class, shared by the layers."""
    from upipe_compile.measure.eager_twins import eager_twin_backend

    for layer in decoder_layers(model):
        attention = getattr(layer, "self_attn", None)
        if attention is None:
            raise JobError(f"{type(layer).__name__} has no self_attn: the estimate measures softmax-attention "
                           "decoder layers (dense and MoE), not hybrid mixers yet")
        attention.forward = torch.compile(attention.forward, backend=eager_twin_backend, options=options,
                                          fullgraph=True, dynamic=False)


def _shard(model, mesh) -> None:
    """FSDP2 as accelerate applies it (fsdp2_prepare_model, TRANSFORMER_BASED_WRAP): each decoder
    layer, then the root."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                                  output_dtype=torch.bfloat16)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=True)


def _checkpointed_parts(model) -> list:
    """What AC's recompute reruns: transformers checkpoints each layer's ``forward`` (its hooks
    stay outside), so the recompute shows in the layers' children."""
    return [child for layer in decoder_layers(model) for child in layer.children()]


def shape_of(config, model) -> ModelShape:
    """The step-time model's view of a transformers model; a MoE layer's routed experts (3-D
    weights, one slice per expert) also by what one token runs through: ``num_experts_per_tok``
    of ``num_experts``."""
    text = config.get_text_config()
    layer = decoder_layers(model)[0]
    heads = text.num_attention_heads
    top_k = getattr(text, "num_experts_per_tok", 0) or 0
    experts = next((n for name in ("num_experts", "num_local_experts", "n_routed_experts")  # Qwen, Mixtral, DeepSeek
                    if (n := getattr(text, name, 0) or 0)), 0)
    share = top_k / experts if top_k and experts else 1.0
    weights = [p for p in layer.parameters() if p.dim() >= 2]
    return ModelShape(n_layers=text.num_hidden_layers, dim=text.hidden_size, q_heads=heads,
                      kv_heads=getattr(text, "num_key_value_heads", None) or heads,
                      head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
                      layer_weights=sum(p.numel() for p in weights), vocab_size=text.vocab_size,
                      active_layer_weights=round(sum(p.numel() * (share if p.dim() == 3 else 1) for p in weights)),
                      experts_per_token=top_k if share < 1 else 0)


def kept_attention_bytes(shape: ModelShape, job: HFJob, heads_per_stage: int, fused: bool) -> int:
    """keep_attention's saved outputs per rank (what the compiled step keeps and the fake run's
    full recompute does not): each layer's attention output [S/P, Hq, D] bf16, the stage LSEs
    fp32 and with fused blocks the block's output [S/P, dim] (as the torchtitan estimate's)."""
    from upipe_compile.attention.schedule import plan_stages

    schedule = plan_stages(shape.q_heads, shape.kv_heads, job.a2a, heads_per_stage)
    local = job.seq_len // job.cp
    out = shape.q_heads * local * shape.head_dim * 2
    lse = len(schedule.stages) * schedule.q_per_rank * (job.seq_len // job.ring_degree) * 4
    block = local * shape.dim * 2 if fused else 0
    return shape.n_layers * (out + lse + block)


def estimate_hf(job: HFJob, *, gpu_gib: float = H100_80GB_GIB, gpus_per_node: int = 8,
                host_gib: float = HOST_BUDGET_GIB, cuda_kernel: str | None = DEFAULT_CUDA_KERNEL,
                device_ratio: float | None = None) -> Estimate:
    """Measure one training step of ``job``; runs in a fresh fake default process group (call
    it where none exists). Refuses (JobError, UnsupportedAttention) before the step what the
    Trainer path would refuse or the estimate cannot measure."""
    problems = job.problems()
    if problems:
        raise JobError("; ".join(problems))
    if device_ratio is None:
        device_ratio = DEVICE_RATIO if cuda_kernel else 1.0
    config = load_config(job.config)
    start = time.time()
    # A new job compiles its attention afresh: earlier jobs' graphs (other lengths, other
    # models: a search's probes) would only count towards Dynamo's recompile limit.
    torch._dynamo.reset()
    kernel_workspace = workspace.modelled_cuda_kernel(cuda_kernel) if cuda_kernel else contextlib.nullcontext()
    with _quiet_transformers(), _fake_job(job.world), private_sharding_fake_mode(), kernel_workspace, \
            plain_stack_loops(), counting_eager_calls() as eager_calls:
        memory, model, kept_on_host = _measure(job, config, cuda_kernel)
    shape = shape_of(config, model)
    heads_per_stage = job.heads_per_stage or job.a2a
    calls = dict(eager_calls)
    modelled, modelled_host = {}, {}
    if cuda_kernel:
        modelled["cublas_workspaces"] = CUBLAS_WORKSPACES_GIB
    if job.fsdp_cpu_offload:
        modelled["cpu_offload_staging"] = round(offload_staging_bytes(model) / GIB, 6)
    if job.keep_attention:
        kept = round(kept_attention_bytes(shape, job, heads_per_stage, "fused block" in calls) / GIB, 6)
        # On the host only where the trainer's offloader takes them beside the block inputs; else
        # every layer's stay on the device through the backward.
        (modelled_host if kept_on_host else modelled)["kept_attention_outputs"] = kept
    setup = Setup(seq_len=job.seq_len, cp=job.cp, heads_per_stage=heads_per_stage, ring_degree=job.ring_degree,
                  full_ac=job.gradient_checkpointing, keep_attention=job.keep_attention,
                  offload_block_inputs=job.offload_block_inputs, element_bytes=2,
                  offload_state=job.fsdp_cpu_offload, fsdp_shards=job.world)
    return result_of(memory, seq_len=job.seq_len, cuda_kernel=cuda_kernel, world=job.world, cp=job.cp,
                     heads_per_stage=heads_per_stage, ring_degree=job.ring_degree, modelled=modelled, modelled_host=modelled_host,
                     gpu_gib=gpu_gib, gpus_per_node=gpus_per_node, host_gib=host_gib, device_ratio=device_ratio,
                     step_time=step_time_report(shape, setup), attention_calls=calls, start=start)


@contextlib.contextmanager
def _fake_job(world: int):
    from upipe_compile.measure.memory import fake_process_group

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with fake_process_group(world):
        yield


@contextlib.contextmanager
def _quiet_transformers():
    """transformers' deprecation and cache notes are not the estimate's output."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        # FSDP2's note on the root's view output (the loss): no in-place op follows it here
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module", category=UserWarning)
        yield


def _measure(job: HFJob, config, cuda_kernel):
    """(the step's StepMemory, the model, whether the offloader takes keep_attention's outputs)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh

    model = build_model(config)
    settings = StackSettings(job.loss_chunk_tokens, job.mlp_tile_tokens, job.offload_block_inputs,
                             host_memory_reserve_gib=0)
    offloader = apply_stack(model, settings, _trainer_arguments(job))  # its checks refuse what the Trainer refuses
    if offloader is not None:
        offloader.host_device = HOST  # the tracker counts "meta" as the host
    if job.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # Meshes outside fake mode (they hold real rank lists): UPipeTrainer's layouts (("dp", "cp"),
    # or ("dp", "cp_ring", "cp_a2a") with a ring), FSDP over every rank.
    if job.ring_degree == 1:
        cp_mesh = init_device_mesh("cpu", (job.nodes, job.cp), mesh_dim_names=("dp", "cp"))["cp"]
    else:
        layout = init_device_mesh("cpu", (job.nodes, job.ring_degree, job.a2a),
                                  mesh_dim_names=("dp", "cp_ring", "cp_a2a"))
        cp_mesh = layout["cp_ring", "cp_a2a"]
    fsdp_mesh = init_device_mesh("cpu", (job.world,), mesh_dim_names=("fsdp",))
    options = {"cp_mesh": cp_mesh}
    if job.heads_per_stage is not None:
        options["heads_per_stage"] = job.heads_per_stage
    _route_attention(model, options)
    _shard(model, fsdp_mesh)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)  # non-fake: the meta model, the meshes' ranks
    with fake_mode:
        model.to_empty(device="cpu")
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
        for param in model.parameters():  # the state a first step leaves (as upipe_compile.estimate.step does)
            param.grad = torch.zeros_like(param)
        optimizer.step()
        optimizer.zero_grad()
        tracker = PhaseTracker(model, optimizer, checkpointed=_checkpointed_parts(model),
                               offloaded_state=job.fsdp_cpu_offload)
        fused = cuda_kernel is not None
        norms = _fused_hf_rms_norms(model) if fused else contextlib.nullcontext()
        with kernel_models(fused, fused), norms, tracker:
            memory = _train_step(model, optimizer, tracker, job, config, cp_mesh)
    return memory, model, offloader is not None and offloader.kept_outputs


def _train_step(model, optimizer, tracker: PhaseTracker, job: HFJob, config, cp_mesh):
    """UPipeTrainer's training_step for one micro-batch of one row: the batch (rank 0's shard),
    the model's forward with its loss, backward, clipping, the optimizer step."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from upipe_compile.integrations.hf_batch import upipe_batch

    def label(name):
        tracker.outside_model = name

    vocab = config.get_text_config().vocab_size
    with unset_fake_temporarily():  # the batch's metadata (positions) is data: real, as the Trainer reads it
        full = {"input_ids": torch.randint(0, vocab, (1, job.seq_len)),
                "labels": torch.randint(0, vocab, (1, job.seq_len))}
        batch = upipe_batch(full, cp_mesh, world=job.cp)
        num_items = torch.tensor(float(job.seq_len - 1))
    on_device = {key: value.clone() for key, value in full.items()}  # the collated row on every CP rank's GPU
    batch = {key: (value.clone() if key != "position_ids" else value) for key, value in batch.items()}
    saved = SavedOnDevice(tracker, model)
    at_loss = {}
    loss_function = model.loss_function

    def loss_then(logits, *args, **kwargs):
        # the model calls its loss inside forward: from here on it is the loss phase
        at_loss["logits"] = logits.numel() * logits.element_size() if isinstance(logits, torch.Tensor) else 0
        at_loss["after_forward"] = tracker.get_tracker_snapshot("current").get(DEVICE, {}).get("Total", 0)
        label("loss")
        return loss_function(logits, *args, **kwargs)

    model.loss_function = loss_then
    optimizer.zero_grad()
    label("forward")
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        outputs = model(**batch, num_items_in_batch=num_items, use_cache=False)
    loss = outputs.loss * job.world  # the Trainer scales it by the processes (a scalar)
    del outputs
    loss.backward()
    label("grad clip")
    torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0, foreach=True)
    label("optimizer step")
    optimizer.step()
    del on_device
    return measured(tracker, saved, at_loss.get("logits", 0), at_loss.get("after_forward", 0))


def max_context_hf(job: HFJob, *, gpu_gib: float = H100_80GB_GIB, gpus_per_node: int = 8,
                   host_gib: float = HOST_BUDGET_GIB, cuda_kernel: str | None = DEFAULT_CUDA_KERNEL,
                   device_ratio: float | None = None, progress: bool = True):
    """The largest ``--seq-len`` (a multiple of 1024 x P, x 2 with a ring) that fits both budgets, by the
    estimate's search (upipe_compile.estimate.search) from ``job.seq_len``: (tokens, its Estimate,
    probes, the bound that stopped it)."""
    def estimate_at(seq_len: int) -> Estimate:
        return estimate_hf(replace(job, seq_len=seq_len), gpu_gib=gpu_gib, gpus_per_node=gpus_per_node,
                           host_gib=host_gib, cuda_kernel=cuda_kernel, device_ratio=device_ratio)

    return search(estimate_at, job.seq_len, 1024 * sequence_multiple(job.cp, job.ring_degree), gpu_gib=gpu_gib,
                  host_gib=host_gib, progress=progress, name="--seq-len")


def command(args, unknown: list[str]) -> int:
    """``--hf``: the estimate of a transformers model trained by UPipeTrainer, one step or
    ``--max-context``; prints the report, 0 (2 and the problems for arguments that do not make
    a job)."""
    problems = []
    if args.config is not None or args.module is not None:
        problems.append("--hf and --config/--module are two kinds of job: give one")
    if args.hf is None:
        problems.append("give --config JOB (torchtitan) or --hf CONFIG (transformers)")
    if args.plan:
        problems.append("--plan is for torchtitan jobs (--config)")
    if unknown:
        problems.append(f"unknown arguments {unknown} (torchtitan overrides go with --config)")
    for flag in ("seq_len", "cp"):
        if args.hf is not None and getattr(args, flag) is None:
            problems.append(f"--hf needs --{flag.replace('_', '-')}")
    if problems:
        print("error: " + "; ".join(problems), file=sys.stderr)
        return 2
    job = HFJob(args.hf, seq_len=args.seq_len, cp=args.cp, nodes=args.nodes, ring_degree=args.ring_degree, heads_per_stage=args.heads_per_stage,
                loss_chunk_tokens=args.loss_chunk_tokens, mlp_tile_tokens=args.mlp_tile_tokens,
                offload_block_inputs=args.offload_block_inputs, keep_attention=args.keep_attention,
                gradient_checkpointing=not args.no_gradient_checkpointing, fsdp_cpu_offload=args.fsdp_cpu_offload)
    budgets = dict(gpu_gib=args.gpu_gib, gpus_per_node=args.gpus_per_node, host_gib=args.host_gib,
                   cuda_kernel=args.cuda_kernel, device_ratio=args.device_ratio)
    if args.max_context:
        found, result, probes, bound = max_context_hf(job, progress=not args.json, **budgets)
        payload, text = max_context_output(found, result, probes, bound, gpu_gib=args.gpu_gib,
                                           host_gib=args.host_gib, job=job)
    else:
        result = estimate_hf(job, **budgets)
        payload, text = result.as_json(), format_report(result, job)
    print(json.dumps({**payload, "hf": job.as_json()}) if args.json else text)
    return 0
