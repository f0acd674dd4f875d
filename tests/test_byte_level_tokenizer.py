"""The serving tokenizer of byte-level GGUFs (glmserve/models/byte_level_tokenizer.py) against transformers'
conversion of the same file: the serialized backend, token ids, decoded text, token pieces, the chat template
(tests/test_startup_imports.py checks that serving imports no transformers)."""

from __future__ import annotations

import json

import jinja2
import pytest
from transformers.convert_slow_tokenizer import bytes_to_unicode as transformers_bytes_to_unicode
from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

from glmserve.byte_level import bytes_to_unicode
from glmserve.errors import InvalidRequestError
from glmserve.models.byte_level_tokenizer import PLAIN_BYTE_LEVEL_PRE, ByteLevelTokenizer, handles
from glmserve.models.gguf_loader import embedded_default_gguf, load_gguf

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "  leading spaces,\ttabs\nand\r\nnewlines   trailing  ",
    "长上下文推理需要稀疏注意力，中文与 English mixed; 数字 12345 和标点。",
    "emoji 🙂🚀 and accents: café naïve Zürich — ‘quotes’",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|> special tokens inside text <|im_start|>",
    "code: def f(x):\n    return x ** 2  # comment\n",
    "",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer in Chinese."}, {"role": "user", "content": "你好，世界"},
     {"role": "assistant", "content": "你好！"}, {"role": "user", "content": "再说一次 🙂"}],
]


@pytest.fixture(scope="module")
def metadata() -> dict:
    return load_gguf(embedded_default_gguf()).reader.metadata


@pytest.fixture(scope="module")
def ours(metadata) -> ByteLevelTokenizer:
    return ByteLevelTokenizer.from_metadata(metadata)


@pytest.fixture(scope="module")
def reference():
    return load_gguf(embedded_default_gguf()).tokenizer()


def test_backend_is_the_one_transformers_converts(ours, reference):
    assert json.loads(ours.backend_tokenizer.to_str()) == json.loads(reference.backend_tokenizer.to_str())
    assert len(ours) == len(reference) and ours.get_vocab() == reference.get_vocab()


def test_token_ids_and_text_equal_transformers(ours, reference):
    for text in TEXTS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == reference.encode(text, add_special_tokens=special)
        ids = ours.encode(text)
        assert ours(text)["input_ids"] == reference(text)["input_ids"] == ids, text
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
        assert ours.convert_ids_to_tokens(ids) == reference.convert_ids_to_tokens(ids)
    assert ours(TEXTS[:3])["input_ids"] == reference(TEXTS[:3])["input_ids"]
    assert ours.encode(TEXTS[4]).count(ours.backend_tokenizer.token_to_id("<|im_start|>")) == 2  # kept whole
    for attr in ("bos_token", "eos_token", "bos_token_id", "eos_token_id", "chat_template", "special_tokens_map"):
        assert getattr(ours, attr) == getattr(reference, attr), attr


def test_chat_template_equals_transformers(ours, reference):
    for messages in CONVERSATIONS:
        for prompt in (True, False):
            want = reference.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=True,
                                                 return_dict=False)
            assert ours.apply_chat_template(messages, add_generation_prompt=prompt) == list(want)
            assert ours.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False) == \
                reference.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False)


def test_template_sandbox_as_transformers(metadata, reference):
    """tojson without HTML escaping, tools and extra variables, loop controls, raise_exception, the special
    tokens as variables, trim/lstrip blocks: one template rendered by both."""
    template = (
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('no bad roles') }}"
        "{% endif %}{% if loop.index > 2 %}{% break %}{% endif %}\n  {% if m.role %}\n{{ m.role }}: "
        "{{ m.content | tojson }}{% endif %}\n{% endfor %}{{ tools | tojson(indent=2) }}{{ flag }}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tokenizer = ByteLevelTokenizer(ours_backend(metadata), template, reference.special_tokens_map)
    reference.chat_template = template
    try:
        messages = [{"role": "user", "content": "<b>&\"中文\"</b>"}, {"role": "assistant", "content": "ok"},
                    {"role": "user", "content": "cut by break"}]
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"x": "é"}}}]
        got = tokenizer.apply_chat_template(messages, tools, add_generation_prompt=True, tokenize=False, flag="F")
        assert got == reference.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                    tokenize=False, flag="F")
        assert '"<b>&\\"中文\\"</b>"' in got and "cut by break" not in got
        with pytest.raises(jinja2.exceptions.TemplateError, match="no bad roles"):
            tokenizer.apply_chat_template([{"role": "bad", "content": ""}])
        with pytest.raises(jinja2.exceptions.SecurityError):  # the sandbox refuses Python internals
            ByteLevelTokenizer(tokenizer.backend_tokenizer, "{{ messages.__class__.__mro__ }}", {}) \
                .apply_chat_template([{"role": "user", "content": ""}], tokenize=False)
    finally:
        reference.chat_template = metadata["tokenizer.chat_template"]
    with pytest.raises(InvalidRequestError, match="no chat template"):
        ByteLevelTokenizer(tokenizer.backend_tokenizer, None, {}).apply_chat_template(messages)


def ours_backend(metadata):
    return ByteLevelTokenizer.from_metadata(metadata).backend_tokenizer


def test_handles_only_what_it_builds_exactly(metadata):
    assert handles(metadata)
    assert not PLAIN_BYTE_LEVEL_PRE & set(GGUF_PRE_TOKENIZER_SPLITS)  # transformers adds a split for none of them
    assert not handles({**metadata, "tokenizer.ggml.pre": "qwen2"})
    assert not handles({**metadata, "tokenizer.ggml.add_bos_token": True})
    assert not handles({**metadata, "tokenizer.ggml.model": "llama"})
    assert bytes_to_unicode() == transformers_bytes_to_unicode()


def test_transformers_view_for_llguidance(ours):
    hf = ours.transformers
    assert hf.backend_tokenizer.to_str() == ours.backend_tokenizer.to_str()
    assert hf.encode(TEXTS[2]) == ours.encode(TEXTS[2]) and hf.eos_token_id == ours.eos_token_id

