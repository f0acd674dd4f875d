"""The tokenizer a GGUF file's `tokenizer.*` metadata describes, built from an already parsed header.

`PreTrainedTokenizerFast.from_pretrained(dir, gguf_file=...)` parses the whole file's metadata a second time
(transformers' `get_gguf_tokenizer`, a Python walk over the 49K-entry vocabulary and merges) before it
converts. Here the same conversion (transformers' `convert_gguf_tokenizer`: byte-level BPE for `gpt2`,
sentencepiece for `llama`, the control and user-defined tokens added, the `tokenizer.ggml.pre` split
regex) runs on the values glmserve/models/gguf_reader.py already read, and the tokenizer config is derived
as `get_gguf_tokenizer` derives it (transformers/integrations/gguf/gguf_tokenizer_mapping.py, followed, not
copied): the same token for token (tests/test_gguf_loader.py checks it against `from_pretrained`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerFast
from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

# tokenizer_config entry -> the GGUF key of the token id it names (get_gguf_tokenizer's table)
_SPECIAL_TOKEN_IDS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def tokenizer_from_metadata(architecture: str, metadata: Mapping[str, Any]) -> PreTrainedTokenizerFast:
    """A fast tokenizer from a GGUF header's metadata (vocabulary, merges, special tokens, `add_bos_token`,
    chat template)."""
    grouped = {
        group: {name: _plain(metadata[f"tokenizer.{key}"]) for key, name in renames.items()
                if f"tokenizer.{key}" in metadata}
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer_dict, config = grouped["tokenizer"], grouped["tokenizer_config"]
    kind = tokenizer_dict.get("tokenizer_type")
    if kind == "llama":  # llama.cpp adds BOS to a sentencepiece vocabulary whose file does not say otherwise
        config.setdefault("add_bos_token", True)
    elif kind == "gemma4":  # its chat template writes <bos> itself
        config["add_bos_token"] = False
    for name, key in _SPECIAL_TOKEN_IDS.items():
        token_id = metadata.get(key)
        config[name] = tokenizer_dict["tokens"][token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(architecture, tokenizer_dict)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)


def _plain(value: Any) -> Any:
    """numpy arrays (the reader's fixed-size arrays: scores, token types) as the lists transformers expects."""
    return value.tolist() if isinstance(value, np.ndarray) else value
