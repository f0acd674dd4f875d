"""GPT-2's byte-level alphabet: the printable character each byte is spelled with in byte-level BPE vocabularies
(GPT-2, SmolLM2, Llama 3, Qwen). Used by the GGUF tokenizer (glmserve/models/byte_level_tokenizer.py) and by the
server's token bytes (glmserve/server/logprobs.py) without importing transformers."""

from __future__ import annotations

import functools


@functools.cache
def bytes_to_unicode() -> dict[int, str]:
    """byte -> character, as openai/gpt-2 src/encoder.py builds it: the printable Latin-1 bytes ('!'..'~',
    '¡'..'¬', '®'..'ÿ') stand for themselves, the other 68 bytes take U+0100 onwards in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    for extra, b in enumerate(b for b in range(256) if b not in table):
        table[b] = chr(256 + extra)
    return dict(sorted(table.items()))
