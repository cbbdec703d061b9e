"""torchtitan 0.3 jobs that write and read checkpoints through torchtitan's own
CheckpointManager (DCP), for test_torchtitan03_checkpoint.py. Module-level for spawned ranks.

:func:`run_job` follows 0.3's Trainer as tt03_jobs.train does (same CPU stand-ins: the device,
the seeded packed rows, varlen_attn at CP = 1, fp32 attention), and beside it what the Trainer
does with checkpoints: ``checkpoint.build`` with the dataloader, model, optimizers, schedulers
and the train state; ``checkpointer.load`` before the first step, a step counter that starts
after the loaded step, ``checkpointer.save`` after every step; and train.py's
``--checkpoint.create_seed_checkpoint`` (model built and initialised unparallelized on one
rank, saved as step 0)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

import tt03_jobs as jobs
from tests_support import attention_events, full_tensor, wrapped_name

STEPS = 4


class SeededRows(Stateful):
    """The dataloader: the n-th row it gives is tt03_jobs.training_batch(seq, n); its state,
    how many it gave, is checkpointed, so a resumed job goes on with the next row."""

    def __init__(self, seq_len: int):
        self.seq_len, self.given = seq_len, 0

    def __iter__(self):
        while True:
            self.given += 1
            yield jobs.training_batch(self.seq_len, self.given)

    def state_dict(self):
        return {"rows_given": self.given}

    def load_state_dict(self, state_dict):
        self.given = state_dict["rows_given"]


class JobState(Stateful):
    """What the Trainer's own methods read of ``self`` here: its checkpointed counters (by
    Trainer.state_dict / load_state_dict: the step, the tokens seen) and what
    post_dataloading_process reads."""

    def __init__(self, config, parallel_dims, model, upipe_on: bool):
        self.config, self.parallel_dims, self.model_parts = config, parallel_dims, [model]
        self.model_config, self.upipe_on = config.model_spec.model, upipe_on
        self.step = self.ntokens_seen = 0

    def state_dict(self):
        from torchtitan.trainer import Trainer

        return Trainer.state_dict(self)

    def load_state_dict(self, state_dict):
        from torchtitan.trainer import Trainer

        Trainer.load_state_dict(self, state_dict)


def run_job(cp: int, dump_folder: str, overrides: tuple[str, ...] = (), stop_after: int | None = None) -> dict:
    """The CPU debug config (two layers) at CP = ``cp`` with checkpointing on, its checkpoints
    under ``dump_folder``/checkpoint, ``overrides`` on the command line; training stops after
    step ``stop_after`` (a job cut short), else at ``training.steps``. With
    ``--checkpoint.create_seed_checkpoint`` it only writes the seed checkpoint (one rank).
    Returns the model's state_dict keys and, for a training job, whether a checkpoint was
    loaded, the logged losses by step, this rank's upipe op counts of each step and every
    parameter's full tensor at the end."""
    from unittest import mock

    from torchtitan.components.loss import IGNORE_INDEX
    from torchtitan.distributed import ParallelDims
    from torchtitan.trainer import Trainer

    from upipe_compile.integrations.torchtitan.estimate_job import torchtitan_on_cpu
    from upipe_compile.integrations.torchtitan.release_03.trainer import UPipeTrainer, take_over, upipe_loss

    torchtitan_on_cpu()
    torch._dynamo.reset()
    config = jobs.load_config(f"--parallelism.context_parallel_degree={cp}", f"--training.steps={STEPS}",
                              f"--dump_folder={dump_folder}", "--checkpoint.enable", *overrides)
    config.model_spec.model.layers = config.model_spec.model.layers[:jobs.LAYERS]
    upipe_on = take_over(config)
    model_config = config.model_spec.model
    parallel_dims = ParallelDims.from_config(config.parallelism, dist.get_world_size())
    parallel_dims.build_mesh()
    model_config.update_from_config(config=config)

    seed_checkpoint = config.checkpoint.create_seed_checkpoint
    with torch.device("meta"):
        model = model_config.build()
    if not seed_checkpoint:  # as the Trainer: a seed checkpoint is written unparallelized
        model = config.model_spec.parallelize_fn(
            model, parallel_dims=parallel_dims, training=config.training, parallelism=config.parallelism,
            compile_config=config.compile, ac_config=config.activation_checkpoint, dump_folder=config.dump_folder)
    model.to_empty(device="cpu")
    # The seed checkpoint's values differ from a training job's own initialisation: a job that
    # did not load its checkpoint cannot match one that did.
    torch.manual_seed(0 if seed_checkpoint else 1)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    loss_fn = config.loss.build(compile_config=config.compile)
    if upipe_on and config.compile.enable and "loss" in config.compile.components:
        loss_fn = upipe_loss(config, loss_fn)
    loss_fn.set_lm_head(model.lm_head)
    model._skip_lm_head = True
    optimizers = config.optimizer.build(model_parts=[model])
    lr_schedulers = config.lr_scheduler.build(optimizers=optimizers, training_steps=config.training.steps)
    job = JobState(config, parallel_dims, model, upipe_on)
    rows = SeededRows(config.training.seq_len)
    checkpointer = config.checkpoint.build(dataloader=rows, model_parts=[model], optimizers=optimizers,
                                           lr_schedulers=lr_schedulers, states={"train_state": job},
                                           sd_adapter=None, base_folder=config.dump_folder)
    state_keys = list(model.state_dict())
    if seed_checkpoint:
        checkpointer.save(curr_step=0, last_step=True)
        checkpointer.close()
        return {"state_keys": state_keys}

    post_dataloading = UPipeTrainer.post_dataloading_process if upipe_on else Trainer.post_dataloading_process
    loaded = checkpointer.load(step=config.checkpoint.load_step)
    losses, counts = {}, []
    batches = iter(rows)
    with contextlib.ExitStack() as patches:
        if cp == 1:
            patches.enter_context(mock.patch("torchtitan.models.common.attention.varlen_attn", jobs.varlen_on_cpu))
        patches.enter_context(mock.patch("torchtitan.models.common.attention.torch", jobs.torch_with_fp32_attention()))
        while job.step < config.training.steps:
            job.step += 1
            optimizers.zero_grad()
            input_dict, labels = next(batches)
            global_valid_tokens = (labels != IGNORE_INDEX).sum()
            inputs, labels, extra = post_dataloading(job, input_dict, labels)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                pred = model(inputs, **extra)
                loss, _ = loss_fn(pred, labels, global_valid_tokens, positions=extra["positions"])
                del pred
                loss.backward()
            counts.append(dict(attention_events(prof)))
            losses[job.step] = jobs.optimizer_step(model, config, optimizers, lr_schedulers, parallel_dims, loss)
            checkpointer.save(job.step, last_step=job.step == config.training.steps)
            if job.step == stop_after:
                break
    checkpointer.close()
    params = {wrapped_name(name): full_tensor(p).detach().clone() for name, p in model.named_parameters()}
    return {"loaded": loaded, "losses": losses, "counts": counts, "params": params, "state_keys": state_keys}
