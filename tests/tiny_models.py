"""Tiny random-weight checkpoints (Hugging Face format) for every supported architecture."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import ByteLevelBPETokenizer
from transformers import (
    AutoModelForCausalLM,
    Glm4Config,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention keeps key and value blocks in one pool.",
    "长上下文推理需要稀疏注意力和分块缓存。",
    "Prefix caching reuses blocks that hold the same tokens.",
] * 20

COMMON = dict(
    vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False,
    bos_token_id=0, eos_token_id=1, pad_token_id=1,
)

CONFIGS = {
    "llama": lambda: LlamaConfig(**COMMON, rope_theta=10000.0),
    "llama3-scaled": lambda: LlamaConfig(**{**COMMON, "tie_word_embeddings": True}, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2": lambda: Qwen2Config(**COMMON, rope_theta=10000.0),
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=32, rope_theta=10000.0),
    "glm4": lambda: Glm4Config(**COMMON, head_dim=16, partial_rotary_factor=0.5, attention_bias=True),
}


def tiny_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS, vocab_size=vocab_size, min_frequency=1, special_tokens=["<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<s>", eos_token="</s>")


def make_tiny_model(arch: str, out_dir: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    config = CONFIGS[arch]()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger weights than the default init so that logits are not flat
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(out_dir)
    tiny_tokenizer(config.vocab_size).save_pretrained(out_dir)
    return out_dir


# a plain chat template (the tiny tokenizer has none), for server tests that need chat completions
TINY_CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] or '' }}\n{% endfor %}"
                      "{% if add_generation_prompt %}assistant:{% endif %}")


def make_tiny_chat_model(arch: str, out_dir: Path, seed: int = 0) -> Path:
    """`make_tiny_model` whose tokenizer has a chat template."""
    make_tiny_model(arch, out_dir, seed)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(out_dir)
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    tokenizer.save_pretrained(out_dir)
    return out_dir
