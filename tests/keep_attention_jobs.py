"""A transformers Llama with gradient checkpointing under backend="upipe", with and without
upipe's keep_attention context_fn. Module-level for spawned ranks."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import upipe_compile  # noqa: E402
from tests_support import attention_events  # noqa: E402
from upipe_compile.integrations.transformers import register  # noqa: E402
from upipe_compile.stack.keep_attention import keep_attention  # noqa: E402

LAYERS, SEQ, VOCAB = 2, 32, 64


def _model(keep: bool):
    import transformers

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                      use_cache=False, attn_implementation=register())
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).float()
    kwargs = {"use_reentrant": False, **({"context_fn": keep_attention} if keep else {})}
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.train()
    return model


def checkpointed_step(keep: bool, fuse: bool):
    """Two training steps' forward + backward on this rank's shard; returns (logits, param
    grads of step 2, upipe op counts of step 2)."""
    torch._dynamo.reset()
    model = _model(keep)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=gen)
    dout = torch.randn(1, SEQ, VOCAB, generator=gen)
    ids, dout = (upipe_compile.shard_sequence(t, dim=1) for t in (ids, dout))
    positions = upipe_compile.global_positions(ids.shape[1])
    compiled = torch.compile(model, backend="upipe", options={"inner_backend": "aot_eager", "fuse_projections": fuse})

    def step():
        model.zero_grad(set_to_none=True)
        logits = compiled(input_ids=ids, position_ids=positions).logits
        (logits * dout).sum().backward()
        return logits.detach()

    step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        logits = step()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return logits, grads, dict(attention_events(prof))
