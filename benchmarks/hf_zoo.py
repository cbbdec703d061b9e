"""Every decoder-only causal-LM family of the installed transformers under backend="upipe", the
way a new user's first call runs it: a tiny model from the family's own config, loaded with
register()'s attention, compiled, on 2 gloo ranks, against the unsharded eager model.

    python benchmarks/hf_zoo.py [--use-cache {default,off}] [--families a,b] [--timeout S] [--out PATH.md]

Per family: the config class's defaults with only the sizes shrunk (``tiny_config``) and seeded
fp32 weights, identical on every rank. The reference is the model loaded with
``attn_implementation="eager"`` on the full 16 tokens, ``model(input_ids=ids)``. The run under test
is the model loaded with ``attn_implementation=register()``, compiled with backend="upipe"
(inner backend aot_eager), each rank called as a training loop calls it,
``model(input_ids=shard, position_ids=global_positions(8))`` (and ``use_cache=False`` with
``--use-cache off``). Every rank's logits against its slice of the reference, and the summed
parameter gradients of ``sum(logits * dout)`` against the reference's:

- match: every relative error < 1e-4 (the largest ones shown; a gradient under 1e-3 of the
  largest, such as a key bias's, which softmax makes zero but for rounding, against that);
- refused: ``UnsupportedAttention`` on the ranks, raised as it is or by Dynamo as the cause of
  a BackendCompilerFailed (its first line, and the first file:line it names);
- silent: it ran and the numbers differ (the worst outcome: a wrong model, trained without a word);
- crash: any other exception (its type and first line);
- skip: the eager reference could not be built (why).

"cache returned" is what the compiled forward returned as its cache (``cache``,
``past_key_values`` or ``cache_params``): none, or the cache's class. Each row is appended to ``--out`` as its family
finishes, so a partial run is readable; at the end the file is rewritten as one table, the counts
per verdict and the families not swept, with the reason.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from tabulate import tabulate  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(ROOT)  # after site-packages: an installed upipe_compile wins over the bare checkout

from benchmarks.report import emit  # noqa: E402
from upipe_compile.launch import RankError, RankPool  # noqa: E402

WORLD, SEQ_LOCAL = 2, 8
SEQ = WORLD * SEQ_LOCAL
VOCAB = 96
TOLERANCE = 1e-4
NEAR_ZERO = 1e-3  # of the largest parameter gradient: below it a gradient is measured against that
MAX_PARAMETERS = 5_000_000
DETAIL_CHARS = 200  # of a refusal's first line
COLUMNS = ("family", "model class", "verdict", "detail", "cache returned", "s")

# Sizes, set wherever the family's config has the attribute and it is not None (a config's
# attribute_map takes its own spelling: GPT-2's n_embd, ...). A window smaller than a shard.
SIZES = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, sliding_window=6,
    # MoE: 4 experts, 2 per token, the first layer dense where the family has dense layers
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
    # MLA (its key and value heads are the query heads: MLA_HEADS)
    q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    rotary_dim=8, ffn_dim=96, dff=96,  # GPT-J's and CodeGen's partial rotary; OPT's, XGLM's and CTRL's MLP
    # linear attention (Gated DeltaNet)
    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
)
MLA_HEADS = dict(num_key_value_heads=4, head_dim=8)  # head_dim: the rotary part, as MLA configs count it

# Sizes set even where the default is None: None there means "derive it", which some families
# then do not (HunYuan, Ministral, Nemotron)
DERIVED = ("head_dim", "num_key_value_heads")

_MAMBA2 = dict(mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8, mamba_chunk_size=4)
_INKLING = dict(swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16, sliding_window_size=6,
                unpadded_vocab_size=VOCAB)
_PER_LAYER_INPUT = dict(vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16)
# Per family: hybrids whose default config has one layer kind get one mixer layer and one
# attention layer; sizes under names of the family's own, and those that must agree (Mamba heads
# x head dim = expand x hidden); a size the shipped default leaves None where the model needs one.
OVERRIDES = {
    "bamba": dict(attn_layer_indices=[1], **_MAMBA2),
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"], **_MAMBA2),
    "falcon_h1": dict(mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8,
                      mamba_chunk_size=8),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, mamba_d_state=8),
    "nemotron_h": dict(mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=8, n_groups=2, chunk_size=4,
                       moe_shared_expert_intermediate_size=32),
    "mamba2": dict(num_heads=8, n_groups=2, state_size=8, chunk_size=4),
    "zamba": dict(attention_hidden_size=128, attention_head_dim=32, mamba_dt_rank=4, mamba_d_state=8,
                  num_hidden_layers=3, layers_block_type=["linear_attention", "hybrid", "hybrid"]),  # ties 2 hybrids
    "zamba2": dict(attention_hidden_size=128, attention_head_dim=32, n_mamba_heads=8, mamba_headdim=16,
                   mamba_d_state=8, chunk_size=4, adapter_rank=8),
    "lfm2": dict(layer_types=["conv", "full_attention"]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "dory": dict(n_input_layers=1, n_recurrent_layers=1, n_output_layers=1, num_hidden_layers=3,
                 layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "recurrent_gemma": dict(block_types=["recurrent", "attention"], lru_width=64),
    "kimi_linear": dict(num_experts_per_token=2, linear_num_heads=4, linear_head_dim=16),
    "longcat_flash": dict(num_layers=2, ffn_hidden_size=96, expert_ffn_hidden_size=32, moe_topk=2,
                          zero_expert_num=2),
    "inkling_text": _INKLING, "inkling2_text": _INKLING, "inkling2_loop_text": _INKLING,
    "gemma3n_text": dict(num_kv_shared_layers=0, activation_sparsity_pattern=[0.95, 0.0], laurel_rank=16,
                         **_PER_LAYER_INPUT),
    "gemma4_text": _PER_LAYER_INPUT, "gemma4_unified_text": _PER_LAYER_INPUT,
    "cpmant": dict(dim_head=16, dim_ff=96),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], window_size=6),
    "deepseek_v2": dict(num_experts_per_tok=2),
    "zaya": dict(num_experts_per_tok=1),
}

# Families in the causal-LM mapping that are not decoder-only text models built from a config
NOT_DECODER_ONLY = {
    "bert-generation": "the decoder half of an encoder-decoder (cross-attends to an encoder)",
    "trocr": "the decoder half of an encoder-decoder (cross-attends to an image encoder)",
    "xlnet": "a permutation LM: attends both ways without a perm_mask",
}
# sub-configs that make a config multimodal (or a composite around a text model)
COMPOSITE = ("vision_config", "audio_config", "vq_config", "audio_encoder_config", "audio_encoder", "text_config")


def families() -> tuple[list[str], dict[str, str]]:
    """The families the sweep covers, and those it leaves out with the reason."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_MASKED_LM_MAPPING_NAMES)

    covered, left_out = [], {}
    for family in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        config_class = CONFIG_MAPPING[family]
        composite = sorted(set(getattr(config_class, "sub_configs", None) or {}) & set(COMPOSITE))
        if getattr(config_class, "is_encoder_decoder", False):
            left_out[family] = "encoder-decoder"
        elif family in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
            left_out[family] = "a masked-LM encoder (causal only as a decoder half)"
        elif family in NOT_DECODER_ONLY:
            left_out[family] = NOT_DECODER_ONLY[family]
        elif composite:
            text = f"{family}_text"
            left_out[family] = (f"multimodal or composite ({', '.join(composite)})"
                                + (f"; its text model is {text}" if text in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES else ""))
        elif config_class.model_type != family:
            left_out[family] = f"an alias of {config_class.model_type}"
        else:
            covered.append(family)
    return covered, left_out


def tiny_config(family: str):
    """The family's config with its defaults as shipped (use_cache included), only sizes
    shrunk, one layer of each kind it mixes (at least 2), and no randomness (dropout, jitter)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[family]
    default = config_class()
    fields = vars(default)  # what the config stores: not its properties, nor per-layer views
    kwargs = {}
    for name, size in SIZES.items():
        field = config_class.attribute_map.get(name, name)
        if fields.get(field) is not None or (field in fields and name in DERIVED):
            kwargs[field] = size
    if "kv_lora_rank" in kwargs:
        kwargs.update(MLA_HEADS)
    kwargs.update(_layer_kinds(fields), **_no_randomness(fields), **_token_ids(fields))
    kwargs.update(OVERRIDES.get(family, {}))
    return config_class(**kwargs)


def _layer_kinds(fields: dict) -> dict:
    """One layer of each kind in the default layer list, in their order of first use; the
    list resized to the layer count where it has one kind."""
    for name in ("layer_types", "layers_block_type"):
        kinds = list(dict.fromkeys(fields.get(name) or []))
        if kinds:
            layers = max(len(kinds), SIZES["num_hidden_layers"])
            return {"num_hidden_layers": layers, name: (kinds * layers)[:layers]}
    return {}


def _no_randomness(fields: dict) -> dict:
    """Dropout and router jitter off: the ranks and the reference must draw nothing."""
    return {name: 0.0 for name, value in fields.items()
            if isinstance(value, float) and value > 0 and any(k in name for k in ("dropout", "pdrop", "jitter"))}


def _token_ids(fields: dict) -> dict:
    """Special token ids the small vocabulary no longer holds: its last id."""
    def shrunk(value):
        return [shrunk(v) for v in value] if isinstance(value, list) else min(value, VOCAB - 1)

    return {name: shrunk(value) for name, value in fields.items()
            if name.endswith("token_id") and value is not None and shrunk(value) != value}


def build_model(family: str, attn_implementation: str):
    """The family's causal LM from ``tiny_config`` in fp32, training mode, with seeded weights
    identical on every process: matrices ~ N(0, 1/fan_in) and embeddings ~ N(0, 1), so that
    attention is far from uniform; vectors (norms, biases, decays) the family's init plus
    0.1 N(0, 1), keeping each family's conventions (Gemma's 1 + w norms) and making every
    gradient differ."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(family)
    _check_size(config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation).float()
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=gen)
            if id(p) in embeddings:
                p.copy_(noise)
            elif p.dim() >= 2:
                p.copy_(noise / p.shape[-1] ** 0.5)
            else:
                p.add_(0.1 * noise)
    return model.train()


def _check_size(config) -> None:
    """Refuse to allocate a model that is not tiny (sizes in sub-configs SIZES does not reach):
    count its parameters on the meta device first."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        count = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if count > MAX_PARAMETERS:
        raise ValueError(f"the tiny config still has {count:.2e} parameters (over {MAX_PARAMETERS:.0e}): its sizes "
                         "are where SIZES does not reach; give it an OVERRIDES entry")


def make_ids() -> torch.Tensor:
    """The full sequence's token ids, the same on every process."""
    return torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(2))


def make_dout(vocab_out: int) -> torch.Tensor:
    """The full sequence's upstream gradient of the logits (``vocab_out`` wide, which some
    families pad beyond the vocabulary)."""
    return torch.randn(1, SEQ, vocab_out, generator=torch.Generator().manual_seed(3))


def _grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def reference(family: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The unsharded, uncompiled model with transformers' eager attention (and the family's own
    mixers, should register() have routed them in this process), called with the ids alone."""
    from upipe_compile.integrations.transformers_mixers import original_mixers

    with original_mixers():
        model = build_model(family, "eager")
        logits = model(input_ids=make_ids()).logits
        (logits * make_dout(logits.shape[-1])).sum().backward()
    return logits.detach(), _grads(model)


def _cache_returned(out) -> str:
    """The class of the cache the output holds, or "none" (read from its keys: the old names
    warn when read as attributes)."""
    for name in ("cache", "past_key_values", "cache_params"):
        if name in out.keys():
            return type(out[name]).__name__
    return "none"


def sharded_run(family: str, use_cache_off: bool) -> dict:
    """On each rank: the model loaded with register(), compiled with backend="upipe", called on
    this rank's shard as a training loop calls it. Returns the logits, gradients and cache
    returned, or what failed, described here, where an UnsupportedAttention can still be told
    from the rest by its class."""
    import upipe_compile
    from upipe_compile.integrations.transformers import register

    torch._dynamo.reset()
    try:
        model = build_model(family, register())
        compiled = torch.compile(model, backend="upipe", options={"inner_backend": "aot_eager"})
        kwargs = {"use_cache": False} if use_cache_off else {}
        out = compiled(input_ids=upipe_compile.shard_sequence(make_ids(), dim=1),
                       position_ids=upipe_compile.global_positions(SEQ_LOCAL), **kwargs)
        dout = upipe_compile.shard_sequence(make_dout(out.logits.shape[-1]), dim=1)
        (out.logits * dout).sum().backward()
        return {"logits": out.logits.detach(), "grads": _grads(model), "cache": _cache_returned(out)}
    except Exception as error:  # every failure is a verdict; the first one in time is the cause
        refusal = next((e for e in _causes(error) if isinstance(e, upipe_compile.UnsupportedAttention)), None)
        return {"error": f"{type(error).__name__}: {_first_line(error)}", "at": time.time(),
                "refusal": None if refusal is None else _refusal(refusal, error)}


def _causes(error: BaseException) -> list[BaseException]:
    """The error and what it was raised from, outermost first: Dynamo raises a backend's error
    (an UnsupportedAttention too) as BackendCompilerFailed, whose first line says only that."""
    chain = [error]
    while len(chain) < 10:
        inner = getattr(chain[-1], "inner_exception", None) or chain[-1].__cause__ or chain[-1].__context__
        if inner is None or inner in chain:
            break
        chain.append(inner)
    return chain


def _first_line(error: BaseException) -> str:
    """The message's first line, and the next where the first only introduces it ("...:")."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()] or [""]
    return " ".join(lines[:2]) if lines[0].endswith(":") and len(lines) > 1 else lines[0]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected||; infinite where it is not a number."""
    if actual.shape != expected.shape:
        return float("inf")
    error = ((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)).item()
    return error if error == error else float("inf")


def _compare(ranks: list[dict], logits: torch.Tensor, grads: dict) -> dict:
    """match or silent, with the largest logits and gradient errors (a gradient one side has
    and the other lacks counts against zeros)."""
    logits_error = max(relative_error(r["logits"], part) for r, part in zip(ranks, logits.chunk(WORLD, dim=1)))
    shapes = {name: grad for r in ranks for name, grad in r["grads"].items()} | grads
    # a gradient that is zero by design (a key bias: softmax ignores what it adds to all of a
    # query's scores) is rounding noise on both sides: measure it against the model's gradients
    floor = NEAR_ZERO * max(g.double().norm().item() for g in grads.values())
    grad_errors = {}
    for name, like in shapes.items():
        zero = torch.zeros_like(like)
        ours, expected = sum(r["grads"].get(name, zero) for r in ranks), grads.get(name, zero)
        grad_errors[name] = relative_error(ours, expected) if expected.double().norm() >= floor else \
            (ours.double() - expected.double()).norm().item() / floor
    worst = max(grad_errors, key=grad_errors.get)
    matched = logits_error < TOLERANCE and grad_errors[worst] < TOLERANCE
    detail = f"logits {logits_error:.1e}, grads {grad_errors[worst]:.1e}"
    return {"verdict": "match" if matched else "silent", "detail": detail if matched else f"{detail} ({worst})"}


_SOURCE_LINE = re.compile(r"([\w./-]+\.py):(\d+)")


def _refusal(refusal: BaseException, raised: BaseException) -> str:
    """The refusal's first line (shortened), how it was raised where Dynamo wrapped it, and the
    first file:line the message names."""
    found = _SOURCE_LINE.search(str(refusal))  # messages name files from their package (display_path)
    where = f"{found.group(1)}:{found.group(2)}" if found else "no file:line named"
    first = _first_line(refusal)
    wrapped = "" if raised is refusal else f"(raised as {type(raised).__name__}) "
    return f"{wrapped}{first[:DETAIL_CHARS]}{'...' if len(first) > DETAIL_CHARS else ''} [{where}]"


def _verdict(family: str, pool: RankPool, use_cache_off: bool) -> dict:
    """Reference, sharded run, comparison: the row's verdict and detail (and cache returned)."""
    try:
        logits, grads = reference(family)
    except Exception as error:  # the family cannot be built or run from a config alone
        return {"verdict": "skip", "detail": f"eager reference: {type(error).__name__}: {_first_line(error)}"}
    if not torch.isfinite(logits).all():
        return {"verdict": "skip", "detail": "eager reference: logits not finite"}
    try:
        ranks = pool.run(sharded_run, family, use_cache_off)
    except RankError as error:  # a hang or a dead rank (the pool restarts its workers)
        return {"verdict": "crash", "detail": _first_line(error)}
    failed = sorted((r for r in ranks if "error" in r), key=lambda r: (r["refusal"] is None, r["at"]))
    if failed:
        first = failed[0]
        if first["refusal"] is not None:
            return {"verdict": "refused", "detail": first["refusal"]}
        return {"verdict": "crash", "detail": first["error"]}
    return _compare(ranks, logits, grads) | {"cache returned": ranks[0]["cache"]}


def run_family(family: str, pool: RankPool, use_cache: str = "default") -> dict:
    """One family's row (never raises): verdict, detail, cache returned, seconds."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    start = time.perf_counter()
    row = {"family": family, "model class": MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family], "cache returned": "-"}
    row.update(_verdict(family, pool, use_cache == "off"))
    row["s"] = f"{time.perf_counter() - start:.0f}"
    return {column: row[column] for column in COLUMNS}


VERDICTS = ("match", "refused", "silent", "crash", "skip")
USE_CACHE = {"default": "not passed (the config's)", "off": "use_cache=False passed"}


def _cells(row: dict) -> list[str]:
    return [str(row[c]).replace("|", "\\|") for c in COLUMNS]


def _markdown_row(row: dict) -> str:
    return "| " + " | ".join(_cells(row)) + " |"


def _summary(rows: list[dict]) -> str:
    counts = {v: sum(row["verdict"] == v for row in rows) for v in VERDICTS}
    return "summary: " + ", ".join(f"{v} {n}" for v, n in counts.items()) + f" ({len(rows)} families)"


def _report(header: str, rows: list[dict], left_out: dict[str, str]) -> str:
    table = tabulate([_cells(row) for row in rows], headers=COLUMNS, tablefmt="github", disable_numparse=True)
    not_swept = "\n".join(f"- {family}: {why}" for family, why in left_out.items())
    return f"{header}\n\n{table}\n\n{_summary(rows)}\n\nnot swept ({len(left_out)}):\n{not_swept}"


def _without_out(argv: list[str]) -> list[str]:
    """The command as the table records it: where the table was written (``--out``, often a scratch
    folder before it is copied into benchmarks/results) is not how its rows were made."""
    kept, skip = [], False
    for arg in argv:
        if skip or arg.startswith("--out="):
            skip = False
            continue
        skip = arg == "--out"
        if not skip:
            kept.append(arg)
    return kept


def main(argv=None) -> None:
    import transformers

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--use-cache", choices=("default", "off"), default="default",
                        help="default: the config's use_cache; off: the call also passes use_cache=False")
    parser.add_argument("--families", help="comma-separated subset (default: every family swept)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds one family may take on the ranks")
    parser.add_argument("--out", help="markdown file (default: benchmarks/results/hf_zoo_<use-cache>.md)")
    args = parser.parse_args(argv)
    covered, left_out = families()
    chosen = args.families.split(",") if args.families else covered
    unknown = [f"{f} ({left_out.get(f, 'not in the causal-LM mapping')})" for f in chosen if f not in covered]
    if unknown:
        parser.error("not swept: " + ", ".join(unknown))
    out = args.out or os.path.join(ROOT, "benchmarks", "results", f"hf_zoo_{args.use_cache}.md")
    command = "python benchmarks/hf_zoo.py " + " ".join(_without_out(argv if argv is not None else sys.argv[1:]))
    header = (f"# command: {command.strip()}\n# torch {torch.__version__}, transformers {transformers.__version__}; "
              f"{WORLD} gloo ranks on CPU, {SEQ} tokens, fp32, inner backend aot_eager; match: every relative error "
              f"< {TOLERANCE:g}; use_cache: {USE_CACHE[args.use_cache]}; {len(chosen)} of {len(covered)} families")
    with open(out, "w") as f:
        f.write(f"{header}\n\n{_markdown_row(dict(zip(COLUMNS, COLUMNS)))}\n|{'---|' * len(COLUMNS)}\n")
    rows = []
    with RankPool(WORLD, threads=1, timeout_s=args.timeout) as pool:
        for i, family in enumerate(chosen, 1):
            rows.append(run_family(family, pool, args.use_cache))
            with open(out, "a") as f:
                f.write(_markdown_row(rows[-1]) + "\n")
            print(f"[{i}/{len(chosen)}] {family}: {rows[-1]['verdict']} ({rows[-1]['s']} s)", file=sys.stderr)
    emit(_report(header, rows, left_out), out)


if __name__ == "__main__":
    main()
