"""The serving tokenizer of a byte-level BPE GGUF (the embedded SmolLM2's), on `tokenizers` and jinja2 only.

transformers' tokenizer classes cost a server start ~2.5 s of imports and ~1.5 s of conversion (a deepcopy of
the backend among it; py-spy of a launch, bench/RESULTS.md). For a GGUF whose `tokenizer.ggml.model` is `gpt2`
and whose `tokenizer.ggml.pre` needs no split regex of its own, this builds the same `tokenizers.Tokenizer` that
transformers' `convert_gguf_tokenizer` builds (transformers/integrations/gguf/gguf_tokenizer_mapping.py:
`byte_level_tokenizer`, `add_gguf_special_tokens`; followed, not copied) and renders the chat template in a jinja2
sandbox set up as transformers' `_compile_jinja_template` sets it (utils/chat_template_utils.py: trim_blocks,
lstrip_blocks, loopcontrols, a `tojson` that does not escape HTML, `raise_exception`, `strftime_now`), with the
special tokens as template variables as `apply_chat_template` passes them. Other files keep transformers'
conversion (glmserve/models/gguf_tokenizer.py). tests/test_byte_level_tokenizer.py checks both give the same
serialized backend, token ids (English, Chinese, emoji, special tokens), decoded text and chat-template ids.
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from glmserve.byte_level import bytes_to_unicode
from glmserve.errors import InvalidRequestError

# `tokenizer.ggml.pre` values whose split is the byte-level pre-tokenizer's own regex (transformers adds a Split
# for the others, from llama.cpp's table; tests check that none of these is in it)
PLAIN_BYTE_LEVEL_PRE = frozenset({"default", "gpt2", "smollm"})
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types
_SPECIAL_TOKEN_IDS = {  # tokenizer_config entry -> the GGUF key of the token id it names
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def handles(metadata: Mapping[str, Any]) -> bool:
    """Whether this module builds the file's tokenizer exactly: byte-level BPE with merges, the plain split, and
    no BOS/EOS added to every prompt (their post-processor is transformers' to build)."""
    return (metadata.get("tokenizer.ggml.model") == "gpt2" and "tokenizer.ggml.merges" in metadata
            and metadata.get("tokenizer.ggml.pre", "default") in PLAIN_BYTE_LEVEL_PRE
            and not metadata.get("tokenizer.ggml.add_bos_token", False)
            and not metadata.get("tokenizer.ggml.add_eos_token", False))


def backend_from_metadata(metadata: Mapping[str, Any]) -> Tokenizer:
    """The `tokenizers.Tokenizer` of a file `handles` accepts."""
    spelling = bytes_to_unicode()
    alphabet = frozenset(spelling.values())
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    vocab = {token if alphabet.issuperset(token) else "".join(spelling[b] for b in token.encode("utf-8")): index
             for index, token in enumerate(tokens)}
    merges = [tuple(merge.split(" ")) for merge in metadata["tokenizer.ggml.merges"]]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                                   end_of_word_suffix="", fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
    types = [int(t) for t in metadata.get("tokenizer.ggml.token_type", ())]
    special = [AddedToken(tokens[i], normalized=False, special=True) for i in _special_ids(metadata)]
    control = [AddedToken(token, normalized=False, special=True) for token, kind in zip(tokens, types)
               if kind == _CONTROL and alphabet.issuperset(token)]  # others are llama.cpp mislabels (transformers)
    backend.add_special_tokens(special + control)
    user = [AddedToken(token, normalized=False, special=False) for token, kind in zip(tokens, types)
            if kind == _USER_DEFINED and token in vocab]
    if user:
        backend.add_tokens(user)
    return backend


def _special_ids(metadata: Mapping[str, Any]) -> list[int]:
    return [metadata[key] for key in _SPECIAL_TOKEN_IDS.values() if metadata.get(key) is not None]


class ByteLevelTokenizer:
    """What serving asks of a tokenizer (encode, decode, token pieces, the chat template, the special tokens),
    with transformers' semantics for these calls, on a `tokenizers.Tokenizer`."""

    def __init__(self, backend: Tokenizer, chat_template: str | None, special_tokens: Mapping[str, str | None]):
        self.backend_tokenizer = backend
        self.chat_template = chat_template
        self.special_tokens_map = {name: token for name, token in special_tokens.items() if token is not None}
        self.eos_token = special_tokens.get("eos_token")
        self.bos_token = special_tokens.get("bos_token")
        self.eos_token_id = backend.token_to_id(self.eos_token) if self.eos_token is not None else None
        self.bos_token_id = backend.token_to_id(self.bos_token) if self.bos_token is not None else None

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> ByteLevelTokenizer:
        tokens = metadata["tokenizer.ggml.tokens"]
        special = {name: tokens[metadata[key]] if metadata.get(key) is not None else None
                   for name, key in _SPECIAL_TOKEN_IDS.items()}
        return cls(backend_from_metadata(metadata), metadata.get("tokenizer.chat_template"), special)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str | Sequence[str], add_special_tokens: bool = True) -> dict[str, Any]:
        """`{"input_ids": ids}` of one text, or a list of them of a batch (the part of transformers' call used)."""
        if isinstance(text, str):
            return {"input_ids": self.encode(text, add_special_tokens)}
        encodings = self.backend_tokenizer.encode_batch(list(text), add_special_tokens=add_special_tokens)
        return {"input_ids": [e.ids for e in encodings]}

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(i) for i in ids]

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            add_generation_prompt: bool = False, tokenize: bool = True,
                            **template_kwargs: Any) -> list[int] | str:
        """The conversation rendered by the chat template (the special tokens and `template_kwargs` as template
        variables), then tokenized without special tokens added, as transformers' `apply_chat_template`."""
        if not self.chat_template:
            raise InvalidRequestError("this model's tokenizer has no chat template; use a completion prompt")
        variables = {**self.special_tokens_map, **template_kwargs}
        text = _compiled(self.chat_template).render(messages=messages, tools=tools, documents=None,
                                                    add_generation_prompt=add_generation_prompt, **variables)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    @functools.cached_property
    def transformers(self) -> Any:
        """transformers' tokenizer on the same backend, for the libraries that take one (llguidance's
        `from_tokenizer`); built on first use, so serving without them never imports transformers."""
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast(tokenizer_object=self.backend_tokenizer, chat_template=self.chat_template,
                                       **self.special_tokens_map)


@functools.lru_cache(maxsize=8)
def _compiled(template: str) -> Any:
    """A chat template compiled once, in the sandbox transformers renders templates in (read from its
    `_compile_jinja_template`); jinja2 is imported on the first chat request."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template)
