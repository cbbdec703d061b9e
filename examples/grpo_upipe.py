"""GRPO with TRL's GRPOTrainer and UPipe context parallelism: the policy update over long rollouts
sharded over P ranks, generation and rewards whole.

CPU, 2 ranks, a tiny random Llama, made-up prompts and a toy reward (no downloads):

    torchrun --nproc_per_node 2 examples/grpo_upipe.py

GPUs (one node, P = 8; the model, the prompts and the lengths as arguments). It runs under DDP, so
every GPU holds the whole model with its gradients and AdamW state (16 bytes a parameter): a
small model such as Qwen3-0.6B, until FSDP2 is supported:

    torchrun --nproc_per_node 8 examples/grpo_upipe.py --model Qwen/Qwen3-0.6B --dataset trl-lib/DeepMath-103K \\
        --max-completion-length 65536 --cp-size 8

Against a plain GRPOTrainer script, the UPipe lines are the import, ``UPipeGRPOTrainer`` for
``GRPOTrainer`` and ``upipe_options``. Every rank of a context-parallel group generates the same
completions (the whole model, its own attention); the scoring of prompt + completion (policy, old
policy, reference model) runs on each rank's shard of the sequence.
"""

from __future__ import annotations

import argparse
import os


def tiny_model_and_tokenizer(vocab: int = 64):
    """A tiny random Llama and a word-level tokenizer."""
    import torch
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         pad_token_id=0, eos_token_id=1, bos_token_id=2)
    torch.manual_seed(0)
    tok = Tokenizer(WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t1"))
    tok.pre_tokenizer = WhitespaceSplit()
    return LlamaForCausalLM(config), PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1",
                                                             unk_token="t1")


def toy_prompts(samples: int, vocab: int = 64):
    import torch
    from datasets import Dataset

    gen = torch.Generator().manual_seed(0)
    return Dataset.from_list([{"prompt": " ".join(f"t{int(t)}" for t in torch.randint(3, vocab, (8 + i % 8,),
                                                                                        generator=gen))}
                              for i in range(samples)])


def toy_reward(completions, **kwargs) -> list[float]:
    """More low-numbered words, higher reward."""
    return [sum(1.0 for word in text.split() if word[1:].isdigit() and int(word[1:]) < 32) for text in completions]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a Hugging Face model id or path (default: a tiny random Llama, CPU)")
    parser.add_argument("--dataset", help="a Hugging Face prompt dataset (default: toy prompts and reward)")
    parser.add_argument("--max-completion-length", type=int, default=32)
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--cp-size", type=int, default=None, help="P (default: every process)")
    parser.add_argument("--heads-per-stage", type=int, default=None, help="U (default: P)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--output-dir", default="grpo_upipe_out")
    args = parser.parse_args()

    import torch
    from trl import GRPOConfig

    from upipe_compile.integrations.hf_trainer import UPipeGRPOTrainer

    cuda = torch.cuda.is_available() and args.model is not None
    config = GRPOConfig(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=args.num_generations,
        num_generations=args.num_generations, max_completion_length=args.max_completion_length,
        learning_rate=1e-6 if cuda else 1e-3, logging_steps=1, report_to=[], save_strategy="no",
        use_cpu=not cuda, bf16=cuda, gradient_checkpointing=cuda)
    options = {"inner_backend": "inductor" if cuda else "aot_eager"}
    if args.heads_per_stage:
        options["heads_per_stage"] = args.heads_per_stage
    model, tokenizer = (args.model, None) if args.model else tiny_model_and_tokenizer()
    if args.dataset:
        from datasets import load_dataset

        prompts = load_dataset(args.dataset, split="train")
    else:
        prompts = toy_prompts(64)
    trainer = UPipeGRPOTrainer(model=model, args=config, reward_funcs=toy_reward,  # put your reward here
                               train_dataset=prompts, processing_class=tokenizer,
                               cp_size=args.cp_size or int(os.environ.get("WORLD_SIZE", "1")), upipe_options=options)
    trainer.train()


if __name__ == "__main__":
    main()
