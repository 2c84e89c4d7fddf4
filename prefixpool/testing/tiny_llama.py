"""Write a tiny random-weight Llama checkpoint with a trained tokenizer into DIR (no download).

    .venv-vllm/bin/python -m prefixpool.testing.tiny_llama DIR [--seed 0] [--hidden-size 128 --layers 2 ...]

Run it with the vLLM venv's Python, so the tokenizer files are written by the
transformers vLLM reads them with. The result is a normal Hugging Face model
directory (config.json, model.safetensors, tokenizer.json, tokenizer_config.json
with a Jinja chat template) that `vllm serve DIR` and `prefixpool --model-path DIR`
both load. Knows nothing of prefixpool.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"]
# A template of its own (not prefixpool's built-in turn format), so a test sees the router render it.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CORPUS = [
    "You are a careful assistant. Answer in one short sentence, using plain words only.",
    "The quick brown fox jumps over the lazy dog while the cat sleeps by the warm fire.",
    "Prefix caching keeps the key and value tensors of shared prompt blocks for later requests.",
    "A router sends each request to the server that already holds the longest cached prefix.",
    "<|system|>\n<|user|>\n<|assistant|>\n 0123456789 , . ; : ! ? ( ) [ ] { } - + * / = _ ' \"",
]


def train_tokenizer(vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS * 8, trainer)
    return tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=384)
    parser.add_argument("--max-position", type=int, default=4096)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--intermediate-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(args.vocab_size), bos_token=SPECIALS[0], eos_token=SPECIALS[1],
        pad_token=SPECIALS[2], chat_template=CHAT_TEMPLATE)
    tokenizer.save_pretrained(out)
    torch.manual_seed(args.seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=args.hidden_size,
                         intermediate_size=args.intermediate_size, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                         max_position_embeddings=args.max_position,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False, dtype="float32")
    LlamaForCausalLM(config).save_pretrained(out)
    print(out)


if __name__ == "__main__":
    main()
