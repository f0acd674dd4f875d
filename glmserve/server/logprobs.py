"""Token logprobs in OpenAI's two formats (chat `content` list, legacy completions arrays), and the echoed
prompt's logprobs of a text completion (its first token has none: `null` value and `null` alternatives).

Token strings are the decoded text of each token; `bytes` are the token's raw UTF-8 bytes,
which for byte-level BPE tokenizers (GPT-2 style, SmolLM2, Llama 3, Qwen) may be part of a
multi-byte character: the byte-level alphabet is mapped back to bytes for those.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence
from typing import Any

from tokenizers import decoders

from glmserve.byte_level import bytes_to_unicode
from glmserve.engine.outputs import CompletionOutput
from glmserve.engine.outputs import TokenLogprob as EngineTokenLogprob
from glmserve.server.protocol import ChoiceLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob


class TokenFormatter:
    """Text and bytes of single tokens, cached per token id."""

    def __init__(self, tokenizer: Any) -> None:
        self.as_ids = False  # `text` gives "token_id:ID" (a copy of this formatter: `with_token_ids`)
        self._tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        byte_level = backend is not None and isinstance(backend.decoder, decoders.ByteLevel)
        self._byte_decoder = {c: b for b, c in bytes_to_unicode().items()} if byte_level else None
        self.text = functools.lru_cache(maxsize=65536)(self._text)
        self.bytes = functools.lru_cache(maxsize=65536)(self._bytes)

    def _text(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.as_ids else self._tokenizer.decode([token_id])

    def with_token_ids(self) -> TokenFormatter:
        """A formatter whose token text is "token_id:ID", as vLLM's `return_tokens_as_token_ids`."""
        out = TokenFormatter(self._tokenizer)
        out.as_ids = True
        return out

    def _bytes(self, token_id: int) -> list[int]:
        if self._byte_decoder is not None:
            piece = self._tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and all(c in self._byte_decoder for c in piece):
                return [self._byte_decoder[c] for c in piece]
        return list(self.text(token_id).encode("utf-8"))


def chat_logprobs(
    fmt: TokenFormatter, token_ids: Sequence[int], logprobs: Sequence[EngineTokenLogprob]
) -> ChoiceLogprobs:
    """`choices[i].logprobs` of a chat completion (or one streamed delta of it).

    `logprobs[i]` belongs to `token_ids[i]`; extra trailing logprobs are ignored.
    """
    content = [
        TokenLogprob(
            token=fmt.text(tid),
            logprob=lp.logprob,
            bytes=fmt.bytes(tid),
            top_logprobs=[TopLogprob(token=fmt.text(t), logprob=v, bytes=fmt.bytes(t)) for t, v in lp.top],
        )
        for tid, lp in zip(token_ids, logprobs)
    ]
    return ChoiceLogprobs(content=content)


def span_logprobs(fmt: TokenFormatter, output: CompletionOutput, start: int, end: int) -> list[TokenLogprob]:
    """The logprobs of the tokens whose text ends within `output.text[start:end]` (a Responses `output_text`
    part, or one delta of it): spans that tile a text give each of its tokens once, so a stream's deltas carry
    the logprobs of the whole answer."""
    first = bisect.bisect_right(output.text_ends, start)
    last = bisect.bisect_right(output.text_ends, end)
    content = chat_logprobs(fmt, output.token_ids[first:last], (output.logprobs or [])[first:last]).content
    return content or []


def completion_logprobs(
    fmt: TokenFormatter,
    token_ids: Sequence[int],
    logprobs: Sequence[EngineTokenLogprob],
    text_offset: int,
) -> CompletionLogprobs:
    """`choices[i].logprobs` of a text completion; offsets start at `text_offset`.

    `logprobs[i]` belongs to `token_ids[i]`; extra trailing logprobs are ignored.
    """
    out = CompletionLogprobs()
    offset = text_offset
    for tid, lp in zip(token_ids, logprobs):
        token = fmt.text(tid)
        out.tokens.append(token)
        out.token_logprobs.append(lp.logprob)
        top: dict[str, float] = {}
        for t, v in lp.top:  # best first: of tokens that decode to one text, the best one's value stays
            top.setdefault(fmt.text(t), v)
        top.setdefault(token, lp.logprob)
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(token)
    return out


def echo_logprobs(
    fmt: TokenFormatter, prompt_token_ids: Sequence[int], scored: Sequence[EngineTokenLogprob | None]
) -> CompletionLogprobs:
    """The echoed prompt's part of `choices[i].logprobs`, offsets from 0; `scored` is the engine's
    `RequestOutput.prompt_logprobs` (None for the first token)."""
    first = fmt.text(prompt_token_ids[0])
    rest = completion_logprobs(fmt, prompt_token_ids[1:], scored[1:], len(first))  # type: ignore[arg-type]
    return CompletionLogprobs(tokens=[first, *rest.tokens], token_logprobs=[None, *rest.token_logprobs],
                              top_logprobs=[None, *rest.top_logprobs], text_offset=[0, *rest.text_offset])
