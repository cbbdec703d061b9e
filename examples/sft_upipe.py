"""Fine-tune a causal LM with TRL's SFTTrainer and UPipe context parallelism.

CPU, 2 ranks, a tiny random Llama and synthetic documents (no downloads):

    torchrun --nproc_per_node 2 examples/sft_upipe.py

GPUs (one node, P = 8, the model and the packed context length as arguments; FSDP2 through
accelerate's ParallelismConfig(cp_size=P) with --fsdp2, DDP without it):

    torchrun --nproc_per_node 8 examples/sft_upipe.py --model Qwen/Qwen3-8B --max-length 1048576 \\
        --cp-size 8 --fsdp2 --dataset trl-lib/Capybara

Against a plain SFTTrainer script, the UPipe lines are the import, ``UPipeSFTTrainer`` for
``SFTTrainer`` and ``upipe_options``; ``padding_free=True`` packs documents into one row that
attends within documents.
"""

from __future__ import annotations

import argparse
import os


def tiny_model_and_tokenizer(vocab: int = 256):
    import torch
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, use_cache=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    tok = Tokenizer(WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t1"))
    tok.pre_tokenizer = WhitespaceSplit()
    return model, PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1", unk_token="t1")


def synthetic_documents(samples: int, vocab: int):
    import torch
    from datasets import Dataset

    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(16, 128, (samples,), generator=gen).tolist()
    return Dataset.from_list([{"input_ids": torch.randint(2, vocab, (n,), generator=gen).tolist()} for n in lengths])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a Hugging Face model id or path (default: a tiny random Llama, CPU)")
    parser.add_argument("--dataset", help="a Hugging Face dataset for SFT (default: synthetic documents)")
    parser.add_argument("--max-length", type=int, default=None, help="tokens per packed row (packing=True)")
    parser.add_argument("--cp-size", type=int, default=None, help="P (default: every process)")
    parser.add_argument("--fsdp2", action="store_true", help="GPUs: FSDP2 + ParallelismConfig(cp_size=P)")
    parser.add_argument("--heads-per-stage", type=int, default=None, help="U (default: P)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=4, help="documents per packed row without --max-length")
    parser.add_argument("--output-dir", default="sft_upipe_out")
    args = parser.parse_args()

    import torch
    from trl import SFTConfig

    from upipe_compile.integrations.hf_trainer import UPipeSFTTrainer
    from upipe_compile.integrations.transformers import register

    cuda = torch.cuda.is_available() and args.model is not None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cp_size = args.cp_size or world
    extra = {}
    if args.fsdp2:
        from accelerate import ParallelismConfig

        extra = dict(fsdp="full_shard", fsdp_config={"fsdp_version": 2},
                     parallelism_config=ParallelismConfig(dp_shard_size=world // cp_size, cp_size=cp_size))
    config = SFTConfig(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=2, learning_rate=1e-4 if cuda else 1e-3, logging_steps=1, report_to=[],
        save_strategy="no", use_cpu=not cuda, bf16=cuda, padding_free=True,
        packing=args.max_length is not None, max_length=args.max_length, gradient_checkpointing=True, **extra)

    if args.model is None:
        model, tokenizer = tiny_model_and_tokenizer()
        model.set_attn_implementation(register())
        train = synthetic_documents(64, model.config.vocab_size)
    else:
        from datasets import load_dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation=register(),
                                                     dtype=torch.bfloat16 if cuda else torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        train = load_dataset(args.dataset, split="train") if args.dataset else \
            synthetic_documents(1024, model.config.vocab_size)

    options = {"inner_backend": "inductor" if cuda else "aot_eager"}
    if args.heads_per_stage:
        options["heads_per_stage"] = args.heads_per_stage
    trainer = UPipeSFTTrainer(model=model, args=config, train_dataset=train, processing_class=tokenizer,
                              cp_size=None if args.fsdp2 else cp_size, upipe_options=options)
    trainer.train()


if __name__ == "__main__":
    main()
