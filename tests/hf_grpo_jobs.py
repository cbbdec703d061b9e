"""TRL's GRPOTrainer, stock on one process and UPipeGRPOTrainer on P gloo ranks: a tiny seeded fp32
model saved to a folder (TRL builds the reference model from its path), a word-level tokenizer,
prompts of a few words, a deterministic reward of the completion's tokens, sampling seeded.
Module-level for spawned RankPool workers."""

from __future__ import annotations

import contextlib
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from hf_trainer_jobs import _common, _distributed_env, _Record, _reset_accelerate, tokenizer  # noqa: E402

VOCAB = 48
PROMPTS = 8


def build_model(family: str = "llama"):
    """hf_stack_jobs' tiny seeded model of the family (config as shipped) with this vocabulary and
    the tokenizer's special ids."""
    from hf_stack_jobs import build_model as stack_model

    return stack_model(family, vocab_size=VOCAB, pad_token_id=0, eos_token_id=1, bos_token_id=2)


def prompts():
    from datasets import Dataset

    gen = torch.Generator().manual_seed(5)
    rows = []
    for i in range(PROMPTS):
        n = 3 + i % 4  # prompts of different lengths: left padding differs by row
        rows.append({"prompt": " ".join(f"t{int(t)}" for t in torch.randint(3, VOCAB, (n,), generator=gen))})
    return Dataset.from_list(rows)


def reward(completions, **kwargs) -> list[float]:
    """Deterministic in the completion's words: more low-numbered words, higher reward."""
    return [sum(1.0 for word in text.split() if int(word[1:]) < VOCAB // 2) - 0.1 * len(text.split())
            for text in completions]


GENERATE = "grpo generate"


def attention_ops(prof) -> dict:
    """How often each upipe op ran, and SDPA kernels outside them: under generate() (the whole
    sequence, as it must be) or elsewhere (plain attention on a shard: a silent wrong answer)."""
    counts: dict = {}
    for event in prof.events():
        if event.name.startswith("upipe::"):
            counts[event.name] = counts.get(event.name, 0) + 1
        elif "scaled_dot_product" in event.name:
            parent, where = event.cpu_parent, "plain sdpa outside upipe"
            while parent is not None:
                if parent.name.startswith("upipe::"):
                    where = None
                    break
                if parent.name == GENERATE:
                    where = "sdpa in generate"
                    break
                parent = parent.cpu_parent
            if where:
                counts[where] = counts.get(where, 0) + 1
    return counts


LOGGED = ("loss", "reward", "reward_std", "kl", "completions/mean_length", "entropy", "aux_loss")


def save_model(folder: str, family: str = "llama") -> str:
    """The model saved once, by the test's own process (saving on the pool's ranks would wait
    on the others): TRL loads the policy and the reference model from this path."""
    path = os.path.join(folder, family)
    if not os.path.isdir(path):
        build_model(family).save_pretrained(path)
    return path


def run(upipe: bool, model_dir: str, family: str = "llama", beta: float = 0.0, num_iterations: int = 1,
        calls: bool = False, aux: bool = False, loss_type: str | None = None, checkpointing: bool = False,
        importance_sampling_level: str = "token", **trainer_kwargs):
    """Train; returns (logged rows, final parameters, each generate() call's output ids with
    ``calls``, the upipe ops the profiler saw with ``upipe``)."""
    from trl import GRPOConfig, GRPOTrainer

    _reset_accelerate()
    if upipe:
        _distributed_env()
    try:
        with tempfile.TemporaryDirectory() as folder:
            tok = tokenizer(VOCAB)
            common = {**_common(os.path.join(folder, "out")), "per_device_train_batch_size": 4, "learning_rate": 0.1}
            # the MoE families' router loss: the config's coefficient with ``aux``, else off in both runs
            moe = {"router_aux_loss_coef": 0.0} if family in ("qwen3_next", "mixtral") and not aux else {}
            extra = {**moe, **({"loss_type": loss_type} if loss_type else {})}
            args = GRPOConfig(**common, **extra, gradient_checkpointing=checkpointing, num_generations=4,
                              max_completion_length=6, beta=beta,
                              num_iterations=num_iterations, bf16=False, temperature=1.0, max_steps=2,
                              importance_sampling_level=importance_sampling_level,
                              log_completions=False)
            logs = _Record()
            kwargs = dict(model=model_dir, args=args, reward_funcs=reward, train_dataset=prompts(),
                          processing_class=tok, callbacks=[logs])
            if upipe:
                from upipe_compile.integrations.hf_trainer import UPipeGRPOTrainer

                trainer = UPipeGRPOTrainer(**kwargs, upipe_options={"inner_backend": "aot_eager"}, **trainer_kwargs)
            else:
                trainer = GRPOTrainer(**kwargs)
            generated = []
            if calls:
                unwrapped = trainer.accelerator.unwrap_model(trainer.model)
                original = unwrapped.generate

                def counted(*a, **kw):
                    with torch.profiler.record_function(GENERATE):
                        out = original(*a, **kw)
                    generated.append(out.detach().clone())
                    return out

                unwrapped.generate = counted
            from upipe_compile.integrations.transformers_mixers import original_mixers

            ops = {}
            if upipe:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    trainer.train()
                ops = attention_ops(prof)
            else:
                with original_mixers() if family == "qwen3_next" else contextlib.nullcontext():  # its own mixers
                    trainer.train()
            params = {name: p.detach().clone()
                      for name, p in trainer.accelerator.unwrap_model(trainer.model).named_parameters()}
            return logs.rows, params, generated, ops
    finally:
        _reset_accelerate()


def run_loss_types(model_dir: str, types: dict) -> dict:
    """UPipeGRPOTrainer on this pool's ranks for each loss type (name: extra GRPOConfig fields), two
    iterations of one generation: {name: (logged rows, final parameters)}."""
    out = {}
    for name, config in types.items():
        rows, params, _, _ = run(True, model_dir, "llama", 0.0, 2, False, loss_type=name, **config)
        out[name] = rows, params
    return out


def refusals(model_dir: str) -> list:
    """Each refused set-up through UPipeGRPOTrainer on this pool's ranks: (case, error chain)."""
    from hf_trainer_jobs import refused

    cases = {"ring_degree": dict(ring_degree=2), "loss_chunk_tokens": dict(loss_chunk_tokens=8)}
    return [(case, refused(run, True, model_dir, **kw)) for case, kw in cases.items()]



def run_resumable(model_dir: str, out: str, resume_from: str | None = None, upipe: bool = True,
                  save_steps: int = 2, max_steps: int = 4):
    """GRPO with a reference model (beta 0.1) and num_iterations=2 (one generation every 2 steps),
    AdamW, checkpoints every ``save_steps`` under ``out``; ``resume_from``: a checkpoint folder to
    resume from (a fresh trainer, as a restarted job has). UPipeGRPOTrainer on this pool's ranks, or
    with ``upipe=False`` TRL's own GRPOTrainer on one process. Returns the steps, logged rows,
    prompts and completions each loss saw, and final parameters (hf_trainer_jobs' ``_Seen``)."""
    from trl import GRPOConfig, GRPOTrainer

    from hf_trainer_jobs import _Seen, checkpoint_args

    _reset_accelerate()
    if upipe:
        _distributed_env()
    try:
        seen = _Seen(keys=("prompt_ids", "completion_ids"))
        args = GRPOConfig(**{**checkpoint_args(out, save_steps, max_steps), "per_device_train_batch_size": 4},
                          num_generations=4, max_completion_length=6, beta=0.1, num_iterations=2, bf16=False,
                          temperature=1.0, log_completions=False)
        kwargs = dict(model=model_dir, args=args, reward_funcs=reward, train_dataset=prompts(),
                      processing_class=tokenizer(VOCAB), callbacks=[seen])
        if upipe:
            from upipe_compile.integrations.hf_trainer import UPipeGRPOTrainer

            trainer = UPipeGRPOTrainer(**kwargs, upipe_options={"inner_backend": "aot_eager"})
        else:
            trainer = GRPOTrainer(**kwargs)
        seen.watch(trainer)
        trainer.train(resume_from_checkpoint=resume_from)
        return seen.result(trainer)
    finally:
        _reset_accelerate()
