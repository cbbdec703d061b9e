"""A real ``transformers.Trainer`` and TRL ``SFTTrainer`` with UPipe on P gloo ranks, and the
same trainer on one process over the full sequences: tiny seeded fp32 Llama, SGD,
gradient accumulation 2. Module-level for spawned RankPool workers."""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

VOCAB = 64
SEQ = 32
INNER = {"inner_backend": "aot_eager"}
HYBRIDS = ("lfm2", "qwen3_next")  # mixers run as upipe stage loops (tests/hf_hybrids_jobs.py)


def build_model(family: str = "llama", attention_dropout: float = 0.0, as_shipped: bool = False):
    """Seeded random fp32 weights, identical on every process; ``"sdpa"`` (the trainer
    switches it to ``"upipe"``). ``as_shipped``: the family's config keeps ``use_cache`` on."""
    if family in HYBRIDS:
        from hf_hybrids_jobs import build_model as hybrid_model

        return hybrid_model(family, "eager", as_shipped)
    if family != "llama":
        from hf_families_jobs import build_model as family_model

        # the reference: transformers' own attention (Gemma2, GPT-OSS have no sdpa)
        return family_model(family, "eager", as_shipped=as_shipped)
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         attention_dropout=attention_dropout, tie_word_embeddings=False, use_cache=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).float()
    from hf_llama_jobs import seeded_weights

    seeded_weights(model, 1)
    return model


def lm_dataset(samples: int = 8, seq: int = SEQ, vocab: int = VOCAB):
    """Rows of ``seq`` tokens, a different number of unlabelled (-100) prompt tokens in each
    (so that micro-batches hold different numbers of labelled tokens)."""
    gen = torch.Generator().manual_seed(3)
    rows = []
    for i in range(samples):
        ids = torch.randint(0, vocab, (seq,), generator=gen)
        labels = ids.clone()
        labels[: 3 + 5 * i % (seq - 4)] = -100
        rows.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return rows


def sft_dataset(samples: int = 12, vocab: int = VOCAB):
    """Pre-tokenised documents of 5 to 15 tokens (TRL packs them padding-free)."""
    from datasets import Dataset

    gen = torch.Generator().manual_seed(4)
    lengths = torch.randint(5, 16, (samples,), generator=gen).tolist()
    return Dataset.from_list([{"input_ids": torch.randint(2, vocab, (n,), generator=gen).tolist()} for n in lengths])


def tokenizer(vocab: int = VOCAB):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t1"))
    tok.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1", unk_token="t1")


class _Record:
    """A TrainerCallback recording every logged training row (its numbers) and its loss."""

    def __new__(cls):
        from transformers import TrainerCallback

        class Record(TrainerCallback):
            def __init__(self):
                self.rows = []

            @property
            def losses(self) -> list[float]:
                return [row["loss"] for row in self.rows]

            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs and "loss" in logs:
                    self.rows.append({k: float(v) for k, v in logs.items() if isinstance(v, (int, float))})

        return Record()


def _common(out: str) -> dict:
    return dict(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2, num_train_epochs=1,
                learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", logging_steps=1, report_to=[],
                use_cpu=True, save_strategy="no", seed=0, disable_tqdm=True, dataloader_num_workers=0)


def _reset_accelerate():
    from accelerate.state import AcceleratorState, GradientState

    # A pool worker runs many jobs: what Dynamo learnt from another model (floats it saw
    # change become symbolic) must not reach this one.
    torch._dynamo.reset()
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _distributed_env():
    """accelerate's MULTI_CPU reads the layout from the environment; the pool's process group
    is already up (accelerate then leaves it alone)."""
    import torch.distributed as dist

    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")


def _result(trainer, record):
    model = trainer.accelerator.unwrap_model(trainer.model)
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return record.losses, params


def run_trainer(upipe: bool, family: str = "llama", seq: int = SEQ, attention_dropout: float = 0.0,
                samples: int = 8, mask_fn=None, cp_size: int | None = None, ring_degree: int = 1,
                gradient_checkpointing: bool = False, keep_attention: bool = False, as_shipped: bool = False):
    """Train with ``transformers.Trainer`` (``upipe``: UPipeTrainer on this pool's ranks);
    returns (logged losses, final parameters)."""
    from transformers import Trainer, TrainingArguments, default_data_collator

    _reset_accelerate()
    if upipe:
        _distributed_env()
    try:
        model = build_model(family, attention_dropout, as_shipped)
        vocab = model.config.vocab_size
        data = lm_dataset(samples, seq, vocab)
        if mask_fn is not None:
            data = [mask_fn(i, row) for i, row in enumerate(data)]
        record = _Record()
        with tempfile.TemporaryDirectory() as out:
            args = TrainingArguments(**_common(out), gradient_checkpointing=gradient_checkpointing)
            if upipe:
                from upipe_compile.integrations.hf_trainer import UPipeTrainer

                trainer = UPipeTrainer(model=model, args=args, train_dataset=data, data_collator=default_data_collator,
                                       callbacks=[record], upipe_options=INNER, cp_size=cp_size,
                                       ring_degree=ring_degree, keep_attention=keep_attention)
                # the user's arguments are left alone (transformers 5.x: activation_checkpointing_kwargs)
                assert getattr(args, "activation_checkpointing_kwargs", args.gradient_checkpointing_kwargs) is None
            else:
                trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=default_data_collator,
                                  callbacks=[record])
            if upipe:
                from tests_support import attention_events

                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    trainer.train()
                return (*_result(trainer, record), dict(attention_events(prof)))
            if family in HYBRIDS:  # the reference runs the family's own mixer functions
                from upipe_compile.integrations.transformers_mixers import original_mixers

                with original_mixers():
                    trainer.train()
            else:
                trainer.train()
        return _result(trainer, record)
    finally:
        _reset_accelerate()


def evaluation_rows() -> list[dict]:
    """The rows :func:`run_evaluate` evaluates: 8, every third right-padded."""
    return [right_padded(i, row) for i, row in enumerate(lm_dataset(8))]


def run_evaluate(upipe: bool, eval_batch: int = 4, predict: bool = False, cp_size: int | None = None):
    """``trainer.evaluate()`` over 8 rows (every third right-padded, different numbers of
    labelled tokens) at ``eval_batch`` rows a batch; with ``predict`` also ``trainer.predict()``:
    (eval loss, predict loss, predicted logits or None)."""
    from transformers import Trainer, TrainingArguments, default_data_collator

    _reset_accelerate()
    import torch.distributed as dist

    if upipe or dist.is_initialized():  # stock Trainer on the pool's ranks too: plain DDP
        _distributed_env()
    try:
        model = build_model()
        data = evaluation_rows()
        with tempfile.TemporaryDirectory() as out:
            args = TrainingArguments(**_common(out), per_device_eval_batch_size=eval_batch)
            if upipe:
                from upipe_compile.integrations.hf_trainer import UPipeTrainer

                trainer = UPipeTrainer(model=model, args=args, data_collator=default_data_collator,
                                       upipe_options=INNER, cp_size=cp_size)
            else:
                trainer = Trainer(model=model, args=args, data_collator=default_data_collator)
            loss = trainer.evaluate(eval_dataset=data)["eval_loss"]
            if not predict:
                return loss, None, None
            prediction = trainer.predict(data)
            return loss, prediction.metrics["test_loss"], torch.as_tensor(prediction.predictions)
    finally:
        _reset_accelerate()


def run_trainer_without_device_copy(upipe: bool):
    """Training at batch 2 with Trainer's copy of each batch to its device left out (as on a
    GPU, where the batch is already there): the shards must be contiguous on their own."""
    from transformers import Trainer

    copy = Trainer._prepare_input
    Trainer._prepare_input = lambda self, data: data
    try:
        return run_trainer(upipe, mask_fn=right_padded, samples=8)
    finally:
        Trainer._prepare_input = copy


def right_padded(i: int, row: dict) -> dict:
    """Every third row right-padded by 2 + i tokens (pad id 0, labels -100); all rows get an
    attention_mask."""
    n = len(row["input_ids"])
    pad = 2 + i if i % 3 == 0 else 0
    mask = [1] * (n - pad) + [0] * pad
    ids = row["input_ids"][: n - pad] + [0] * pad
    labels = row["labels"][: n - pad] + [-100] * pad
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def left_padded(i: int, row: dict) -> dict:
    mask = [0] * 2 + [1] * (len(row["input_ids"]) - 2)
    return {**row, "labels": [-100] * 2 + row["labels"][2:], "attention_mask": mask}


def left_padded_on_the_second_replica(i: int, row: dict) -> dict:
    """Left padding on ranks 2 and 3 only (the second data-parallel replica at P = 2)."""
    import torch.distributed as dist

    return left_padded(i, row) if dist.get_rank() // 2 == 1 else row


def run_sft(upipe: bool, pad_to_multiple_of: int | None = 48, family: str = "llama", as_shipped: bool = False):
    """TRL's SFTTrainer, padding-free packing (one row of 2 documents per micro-batch,
    positions restarting per document)."""
    from trl import SFTConfig, SFTTrainer

    _reset_accelerate()
    if upipe:
        _distributed_env()
    try:
        model = build_model(family, as_shipped=as_shipped)
        record = _Record()
        with tempfile.TemporaryDirectory() as out:
            args = SFTConfig(**_common(out), padding_free=True, pad_to_multiple_of=pad_to_multiple_of, bf16=False,
                             max_length=None, dataset_num_proc=None)
            kwargs = dict(model=model, args=args, train_dataset=sft_dataset(), processing_class=tokenizer(),
                          callbacks=[record])
            if upipe:
                from upipe_compile.integrations.hf_trainer import UPipeSFTTrainer

                trainer = UPipeSFTTrainer(**kwargs, upipe_options=INNER)
            else:
                trainer = SFTTrainer(**kwargs)
            if family in HYBRIDS and not upipe:  # the reference runs the family's own mixer functions
                from upipe_compile.integrations.transformers_mixers import original_mixers

                with original_mixers():
                    trainer.train()
            else:
                trainer.train()
        return _result(trainer, record)
    finally:
        _reset_accelerate()


def sft_config_untouched():
    """UPipeSFTTrainer given an SFTConfig without pad_to_multiple_of: (the user's object's
    value after the trainer is built, the trainer's own)."""
    from trl import SFTConfig

    from upipe_compile.integrations.hf_trainer import UPipeSFTTrainer

    _reset_accelerate()
    _distributed_env()
    try:
        with tempfile.TemporaryDirectory() as out:
            args = SFTConfig(**_common(out), padding_free=True, bf16=False, max_length=None, dataset_num_proc=None)
            trainer = UPipeSFTTrainer(model=build_model(), args=args, train_dataset=sft_dataset(),
                                      processing_class=tokenizer(), upipe_options=INNER)
            return args.pad_to_multiple_of, trainer.args.pad_to_multiple_of
    finally:
        _reset_accelerate()


def refused(job, *args, **kwargs):
    """Run a job that must be refused; returns (type name, message) of the error, or raises
    if it trained."""
    try:
        job(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - the test checks the type and message
        chain, e = [], error
        while e is not None:
            chain.append((type(e).__name__, str(e)))
            e = e.__cause__ or e.__context__
        return chain
    raise AssertionError("trained without an error")


def _nan_column(upipe: bool, seq: int):
    """Where :func:`run_with_nan` puts its NaN: the row's last labelled token, which is on the last
    rank's shard under upipe (None on the other ranks)."""
    import torch.distributed as dist

    if not upipe:
        return seq - 2
    return -2 if dist.get_rank() == dist.get_world_size() - 1 else None


def run_with_nan(upipe: bool, where: str, micro_batch: int, samples: int = 12):
    """Trainer (clipping at 1.0, ``logging_nan_inf_filter`` on) with one NaN, on the last rank's
    shard only under upipe, at micro-batch ``micro_batch`` (counted from 0, gradient accumulation
    2): ``where="loss"`` adds it to that shard's loss (the gradient stays finite), ``"logits"`` puts
    it in one logit of one labelled token (the LM head runs eagerly, outside the compiled
    backbone; the gradient is NaN too). Returns (logged rows, final parameters)."""
    from transformers import Trainer, TrainingArguments, default_data_collator

    _reset_accelerate()
    if upipe:
        _distributed_env()
    try:
        model = build_model()
        column = _nan_column(upipe, SEQ)
        calls = iter(range(10 ** 6))
        if where == "logits":
            def poison(module, args, output):
                if module.training and next(calls) == micro_batch and column is not None:
                    output = output.clone()
                    output[0, column, 0] = float("nan")
                return output

            model.lm_head.register_forward_hook(poison)
        record = _Record()
        with tempfile.TemporaryDirectory() as out:
            args = TrainingArguments(**_common(out), max_grad_norm=1.0, logging_nan_inf_filter=True)
            kwargs = dict(model=model, args=args, train_dataset=lm_dataset(samples),
                          data_collator=default_data_collator, callbacks=[record])
            if upipe:
                from upipe_compile.integrations.hf_trainer import UPipeTrainer

                trainer = UPipeTrainer(**kwargs, upipe_options=INNER)
            else:
                trainer = Trainer(**kwargs)
            if where == "loss":
                compute_loss = trainer.compute_loss

                def poisoned_loss(*a, **kw):
                    loss = compute_loss(*a, **kw)
                    if next(calls) == micro_batch and column is not None:
                        loss = loss + float("nan")  # the loss only: its gradient is the finite one
                    return loss

                trainer.compute_loss = poisoned_loss
            trainer.train()
        return record.rows, _result(trainer, record)[1]
    finally:
        _reset_accelerate()


# --- stopping and resuming ----------------------------------------------------------------------
class _Seen:
    """A TrainerCallback recording the global step each train() starts from and, per logged row, the
    step it was logged at; :meth:`watch` also records each micro-batch's ``keys`` as the trainer's
    loss sees them (this rank's shard under upipe)."""

    def __new__(cls, keys=("input_ids",)):
        from transformers import TrainerCallback

        class Seen(TrainerCallback):
            def __init__(self):
                self.start_step, self.rows, self.batches = None, [], []

            def on_train_begin(self, args, state, control, **kwargs):
                self.start_step = state.global_step

            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs and "loss" in logs:
                    self.rows.append({"step": state.global_step,
                                      **{k: float(v) for k, v in logs.items() if isinstance(v, (int, float))}})

            def watch(self, trainer):
                compute_loss = trainer.compute_loss

                def seen(model, inputs, *a, **kw):
                    if model.training:
                        self.batches.append({k: inputs[k].detach().clone() for k in keys})
                    return compute_loss(model, inputs, *a, **kw)

                trainer.compute_loss = seen

            def result(self, trainer):
                params = _result(trainer, _Record())[1]
                return {"start_step": self.start_step, "rows": self.rows, "batches": self.batches, "params": params}

        return Seen()


RESUME_TOLERANCE = 1e-5  # relative, a resumed run against the uninterrupted one (fp32)


def assert_resumed_as_straight(straight: dict, resumed: dict, checkpoint_step: int):
    """The resumed run starts at the checkpoint's step, sees the straight run's micro-batches from
    there on, and logs its losses and ends with its parameters, within 1e-5 relative (a run that
    starts over or skips data fails here)."""
    assert straight["start_step"] == 0 and resumed["start_step"] == checkpoint_step, resumed["start_step"]
    after = [row for row in straight["rows"] if row["step"] > checkpoint_step]
    assert after and [row["step"] for row in resumed["rows"]] == [row["step"] for row in after], resumed["rows"]
    for row, ref in zip(resumed["rows"], after):
        assert abs(row["loss"] - ref["loss"]) <= RESUME_TOLERANCE * abs(ref["loss"]), (row, ref)
    later = straight["batches"][len(straight["batches"]) - len(resumed["batches"]):]
    assert len(resumed["batches"]) < len(straight["batches"])
    for mine, theirs in zip(resumed["batches"], later, strict=True):
        assert all(torch.equal(mine[k], theirs[k]) for k in theirs), "the resumed run saw other batches"
    for name, p in resumed["params"].items():
        ref = straight["params"][name]
        assert (p - ref).abs().max().item() <= RESUME_TOLERANCE * ref.abs().max().item(), name


def checkpoint_args(out: str, save_steps: int, max_steps: int) -> dict:
    """AdamW (its moments must come back too), checkpoints every ``save_steps`` of ``max_steps``."""
    return {**_common(out), "optim": "adamw_torch", "learning_rate": 0.01, "save_strategy": "steps",
            "save_steps": save_steps, "max_steps": max_steps}


def run_sft_resumable(out: str, resume_from: str | None = None, save_steps: int = 2, max_steps: int = 4):
    """UPipeSFTTrainer, padding-free packing, 16 documents (8 micro-batches of 2, gradient
    accumulation 2), checkpoints under ``out``; ``resume_from``: a checkpoint folder to resume from
    (a fresh trainer and model, as a restarted job has). Returns :meth:`_Seen.result`."""
    from trl import SFTConfig

    from upipe_compile.integrations.hf_trainer import UPipeSFTTrainer

    _reset_accelerate()
    _distributed_env()
    try:
        seen = _Seen()
        args = SFTConfig(**checkpoint_args(out, save_steps, max_steps), padding_free=True, pad_to_multiple_of=48,
                         bf16=False, max_length=None, dataset_num_proc=None)
        trainer = UPipeSFTTrainer(model=build_model(), args=args, train_dataset=sft_dataset(16),
                                  processing_class=tokenizer(), callbacks=[seen], upipe_options=INNER)
        seen.watch(trainer)
        trainer.train(resume_from_checkpoint=resume_from)
        return seen.result(trainer)
    finally:
        _reset_accelerate()
