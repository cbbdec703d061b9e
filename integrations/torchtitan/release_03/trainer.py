"""torchtitan 0.3's Trainer with UPipe context parallelism.

A 0.3 job is a function returning a ``Trainer.Config``; :class:`UPipeTrainer.Config` is 0.3's
with one more section, ``upipe`` (the same fields as the 0.2.2 TOML's ``[upipe]``,
config.py), set from the command line as ``--upipe.heads_per_stage 16`` and so on. The switch
is the same as in 0.2.2: ``compile.enable = True`` with ``compile.backend = "upipe"``;
without it the Trainer is torchtitan's, unchanged.

With it, the Trainer

- checks the whole job before anything is built (job_rules.py, with the facts release_03/facts.py reads), naming the
  field to change;
- sizes 0.3's ChunkedLossWrapper from ``upipe.loss_chunk_tokens`` (chunks of at most that
  many local tokens, whatever ``training.seq_len`` is);
- lets RoPE reach ``training.seq_len`` (0.3 refuses a longer sequence than the model's
  RoPE range, 131072 for Llama3; upipe computes the rows of the positions used, no table,
  rope_positions.py) and lifts 0.3's "varlen attention is not supported with CP" (a limit
  of torchtitan's own CP; here upipe does the CP);
- parallelizes the model with upipe's function in place of the model's own
  (parallelize.parallelize_upipe: no ``apply_cp_to_forward``, blocks compiled with
  backend "upipe" over the CP mesh);
- shards each batch itself (:func:`shard_batch`) instead of torchtitan's
  ``prepare_context_parallel_input``: the documents' attention masks are built from the whole
  sequence's positions first, then tokens, labels and positions are cut in upipe's layout;
- compiles the loss (``"loss"`` in ``compile.components``) with ``upipe.inner_backend``: it has
  no attention to rewrite.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torchtitan.components.loss import ChunkedLossWrapper
from torchtitan.models.common.attention import FlexAttention, VarlenAttention
from torchtitan.trainer import Trainer

from upipe_compile.integrations.torchtitan.config import UPipe
from upipe_compile.integrations.torchtitan.cp_layout import upipe_cp_mesh
from upipe_compile.integrations.torchtitan.compile_blocks import inner_backend, upipe_enabled
from upipe_compile.integrations.torchtitan.release_03.parallelize import check_config, parallelize_upipe
from upipe_compile.integrations.torchtitan.release_03.facts import attention_configs
from upipe_compile.sharding import shard_sequence

log = logging.getLogger(__name__)


def take_over(config) -> bool:
    """What the Trainer does with a job before building anything: with backend "upipe", check
    it (refusing it with the fields to change) and put upipe's parallelize in place of the
    model's own (which it still runs, unchanged, for a job without backend "upipe").
    Returns whether upipe runs the job."""
    if not upipe_enabled(config):
        return False
    check_config(config)
    _rope_tables_reach(config.model_spec.model, config.training.seq_len)
    _size_loss_chunks(config)
    spec = config.model_spec
    parallelize = functools.partial(parallelize_upipe, job=config, stock=spec.parallelize_fn)
    config.model_spec = dataclasses.replace(spec, model=_context_parallel_by_upipe(spec.model),
                                            parallelize_fn=parallelize)
    return True


def _size_loss_chunks(config) -> None:
    """``upipe.loss_chunk_tokens`` > 0 sizes 0.3's ChunkedLossWrapper (lm_head and loss chunk
    by chunk of the local sequence; it needs a count that divides the local tokens): the
    fewest chunks of at most that many tokens each."""
    chunk = config.upipe.loss_chunk_tokens
    if not chunk:
        return
    local = config.training.seq_len // config.parallelism.context_parallel_degree
    count = next(n for n in range(-(-local // chunk), local + 1) if local % n == 0)
    config.loss.num_chunks = count
    log.info("upipe: the loss over %d chunks of %d local tokens", count, local // count)


def _rope_tables_reach(model_config, seq_len: int) -> None:
    """A long-context job's RoPE covers its whole sequence: 0.3 refuses a seq_len beyond a
    layer's ``rope.max_seq_len`` (131072 for Llama3), the range of the table it would build
    (upipe builds none: rope_positions.py). The positions come from the data (each
    document's own, from 0)."""
    for layer in model_config.layers:
        attention = getattr(layer, "attention", None)
        rope = getattr(attention, "rope", None)
        if rope is not None and rope.max_seq_len < seq_len:
            log.info("upipe: %s RoPE range extended from %d to %d positions", type(rope).__qualname__,
                     rope.max_seq_len, seq_len)
            attention.rope = dataclasses.replace(rope, max_seq_len=seq_len)


def _context_parallel_by_upipe(model_config):
    """``model_config`` whose ``update_from_config`` sees no context parallelism: 0.3's Llama3
    and Qwen3 refuse varlen attention with CP there ("Varlen attention is not supported with
    CP"), a limit of torchtitan's own CP; here upipe does the CP."""
    stock = type(model_config)

    def update_from_config(self, *, config, **kwargs):
        single = dataclasses.replace(config.parallelism, context_parallel_degree=1)
        stock.update_from_config(self, config=dataclasses.replace(config, parallelism=single), **kwargs)

    cls = dataclass(kw_only=True, slots=True)(type(stock.__name__, (stock,), {
        "update_from_config": update_from_config, "__qualname__": stock.__qualname__, "__module__": stock.__module__}))
    return cls(**{f.name: getattr(model_config, f.name) for f in dataclasses.fields(model_config) if f.init})


def _masked_attention(config) -> bool:
    """The model's attention takes masks built from positions (varlen or Flex), as the
    Trainer decides."""
    return any(isinstance(getattr(cfg, "inner_attention", None), (VarlenAttention.Config, FlexAttention.Config))
               for _, cfg in attention_configs(config))


def shard_batch(config, parallel_dims, model, input_dict: dict[str, torch.Tensor], labels: torch.Tensor):
    """This rank's ``(inputs, labels, extra_kwargs)`` in upipe's layout. The attention masks
    are the whole sequence's documents, from the full positions (every rank's stages see all
    tokens); tokens, labels and positions are cut to this rank's shard (contiguous, zigzag
    over a ring). Without positions from the dataloader, a row is one document at 0..S-1:
    RoPE on a shard needs its tokens' global positions."""
    inputs = input_dict["input"]
    extra: dict[str, Any] = {key: value for key, value in input_dict.items() if key != "input"}
    positions = extra.get("positions")
    if positions is None:
        positions = torch.arange(inputs.shape[1], device=inputs.device).expand(inputs.shape)
    if _masked_attention(config):
        extra["attention_masks"] = model.get_attention_masks(positions=positions)
    if parallel_dims.cp_enabled:
        mesh = upipe_cp_mesh(config, parallel_dims)
        inputs, labels, positions = (shard_sequence(t, mesh, dim=1) for t in (inputs, labels, positions))
    extra["positions"] = positions
    return inputs, labels, extra


def upipe_loss(config, loss_fn):
    """The Trainer's loss rebuilt with its compile backend set to ``upipe.inner_backend``
    (torch.compile of the loss, when ``"loss"`` is in ``compile.components``)."""
    compile_config = dataclasses.replace(config.compile, backend=inner_backend(config.upipe.inner_backend))
    rebuilt = config.loss.build(compile_config=compile_config)
    if isinstance(loss_fn, ChunkedLossWrapper):
        rebuilt.set_lm_head(loss_fn.lm_head)
    return rebuilt


class UPipeTrainer(Trainer):
    """torchtitan 0.3's Trainer; with ``compile.backend = "upipe"``, UPipe context parallelism."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        upipe: UPipe = field(default_factory=UPipe)
        """UPipe's settings (the 0.2.2 TOML's [upipe] section; see config.py)."""

    def __init__(self, config: Config):
        self.upipe_on = take_over(config)
        super().__init__(config)
        if self.upipe_on and config.compile.enable and "loss" in config.compile.components:
            self.loss_fn = upipe_loss(config, self.loss_fn)

    def post_dataloading_process(self, input_dict, labels):
        if not self.upipe_on:
            return super().post_dataloading_process(input_dict, labels)
        inputs, labels, extra = shard_batch(self.config, self.parallel_dims, self.model_parts[0], input_dict, labels)
        self.ntokens_seen += labels.numel()
        return inputs, labels, extra
