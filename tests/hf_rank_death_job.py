"""A UPipeTrainer job for torchrun on CPU gloo that resumes from its last checkpoint when torchrun
restarts it (tests/test_hf_trainer.py::test_a_rank_that_dies_is_restarted_from_the_last_checkpoint).

    python -m torch.distributed.run --standalone --nproc_per_node 2 --max-restarts 1 \\
        tests/hf_rank_death_job.py OUT_DIR [--kill]

Tiny Llama, AdamW, 6 steps of 2 micro-batches, a checkpoint every 2 steps, the process group's
collective timeout ``COLLECTIVE_TIMEOUT_S`` (``ddp_timeout``). With ``--kill``, rank 1 SIGKILLs
itself in the middle of step 4 (after that micro-batch's forward has started its collectives) on
torchrun's first attempt only; the restarted attempt resumes from ``OUT_DIR``'s last checkpoint.
Each rank writes ``OUT_DIR/rank{r}.json`` (attempt, checkpoint resumed from, first step, logged
losses) and rank 0 the final parameters, ``OUT_DIR/params.pt``; a rank whose training raises
writes ``OUT_DIR/error{r}_attempt{a}.json`` (when, what) first."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

COLLECTIVE_TIMEOUT_S = 60  # a collective waiting longer on a dead peer raises
KILL_AT_STEP = 4  # the 1-based step in whose middle rank 1 dies
KILLED_AT = "killed_at"  # the file rank 1 writes its time of death to


def kill_mid_step(trainer) -> None:
    """Rank 1, first attempt only: SIGKILL in the loss of step KILL_AT_STEP's first micro-batch."""
    compute_loss = trainer.compute_loss
    first_attempt = _attempt() == 0

    def loss_or_death(model, inputs, *a, **kw):
        loss = compute_loss(model, inputs, *a, **kw)
        if first_attempt and trainer.args.process_index == 1 and trainer.state.global_step == KILL_AT_STEP - 1:
            with open(os.path.join(trainer.args.output_dir, KILLED_AT), "w") as f:
                f.write(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        return loss

    trainer.compute_loss = loss_or_death


def _attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def main(out: str, kill: bool) -> None:
    from transformers import TrainingArguments, default_data_collator
    from transformers.trainer_utils import get_last_checkpoint

    from hf_trainer_jobs import INNER, _Seen, build_model, checkpoint_args, lm_dataset
    from upipe_compile.integrations.hf_trainer import UPipeTrainer

    args = TrainingArguments(**checkpoint_args(out, save_steps=2, max_steps=6), ddp_backend="gloo",
                             ddp_timeout=COLLECTIVE_TIMEOUT_S)
    seen = _Seen()
    trainer = UPipeTrainer(model=build_model(), args=args, train_dataset=lm_dataset(24),
                           data_collator=default_data_collator, callbacks=[seen], upipe_options=INNER)
    if kill:
        kill_mid_step(trainer)
    last = get_last_checkpoint(out) if os.path.isdir(out) else None
    rank = trainer.args.process_index
    try:
        trainer.train(resume_from_checkpoint=last)
    except Exception as error:
        with open(os.path.join(out, f"error{rank}_attempt{_attempt()}.json"), "w") as f:
            json.dump({"at": time.time(), "error": f"{type(error).__name__}: {error}"[:500]}, f)
        raise
    result = seen.result(trainer)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"attempt": _attempt(),
                   "resumed_from": os.path.basename(last) if last else None, "start_step": result["start_step"],
                   "rows": result["rows"], "started_at": START}, f)
    if rank == 0:
        torch.save(result["params"], os.path.join(out, "params.pt"))


START = time.time()

if __name__ == "__main__":
    main(sys.argv[1], "--kill" in sys.argv[2:])
