"""A tiny but real HF checkpoint directory for the tests of `model.path`.

A byte-level BPE tokenizer trained here with the `tokenizers` library (with a ChatML chat
template, <|im_end|> ending a turn) and a random Qwen3-MoE built and saved by transformers,
sharded, so loading goes through the shard index. Both in one directory, as on the Hub.
"""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = ["reverse:abcdefghijklm=mlkjihgfedcba", "reverse:nopqrstuvwxyz=zyxwvutsrqpon", "calc 12+345-67=290",
          "call:12+345-67", "=290;", "sort:0123456789=0123456789"]


def train_tokenizer(directory: Path) -> int:
    """Save a tokenizer into `directory`; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    raw.train_from_iterator(CORPUS * 20, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  chat_template=CHAT_TEMPLATE)
    tok.save_pretrained(directory)
    return len(tok)


def make_checkpoint(directory: Path, *, seed: int = 0, **overrides) -> Path:
    """Tokenizer + random Qwen3-MoE (transformers' own init, fp32, several shards) in `directory`."""
    import torch
    import transformers

    directory.mkdir(parents=True, exist_ok=True)
    vocab = train_tokenizer(directory)
    keys = dict(vocab_size=vocab + 4, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                num_experts_per_tok=2, max_position_embeddings=128, tie_word_embeddings=False)
    keys.update(overrides)
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**keys))
    model.save_pretrained(directory, max_shard_size="40KB")
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return directory
