"""Structured output: grammars compiled by llguidance, one matcher per sequence, the batch's token masks.

The shape follows vLLM's structured-output manager (vllm/v1/structured_output/): a grammar is compiled once per
spec and cached (the server compiles it in a worker thread before it submits the request, so the engine thread
only copies the cached matcher); each sequence carries its own matcher, advanced by every token it accepts; each
step fills the rows of one int32 bitmask for the whole batch (llguidance's executor, native threads) and the
sampler applies it with one tensor op. llguidance was kept over xgrammar: no dependencies (xgrammar pulls triton
and tvm-ffi), ~10x faster compiles on the embedded tokenizer, and it refuses JSON-schema keywords it cannot enforce
(if/then/else, not, uniqueItems) instead of ignoring them, so a request that compiles always validates.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

import torch

from glmserve.errors import InvalidRequestError
from glmserve.models.byte_level_tokenizer import ByteLevelTokenizer

GuidedKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
GUIDED_KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "grammar")
# separators as json.dumps writes them (and models do); no free whitespace, so a small model cannot loop on spaces
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 256


class GrammarCompileError(InvalidRequestError):
    """The grammar (schema, regex, lark grammar) cannot be compiled; the message says why."""


@dataclass(frozen=True)
class GuidedSpec:
    """What a request's output must match: a JSON schema (text), any JSON object, a regex, one of the choices
    (a JSON list of strings) or a lark grammar (llguidance's dialect; vLLM's `guided_grammar`)."""

    kind: GuidedKind
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GUIDED_KINDS:
            raise InvalidRequestError(f"unknown guided kind {self.kind!r}; expected one of {GUIDED_KINDS}")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool) -> GuidedSpec:
        return cls("json_schema", json.dumps(schema))  # key order kept: properties are written in it

    @classmethod
    def choice(cls, choices: list[str]) -> GuidedSpec:
        if not choices or not all(isinstance(c, str) for c in choices):
            raise InvalidRequestError("guided_choice must be a non-empty list of strings")
        return cls("choice", json.dumps(choices))


def _lark_string(text: str) -> str:
    return json.dumps(text)  # a JSON string literal is a valid lark string literal


def grammar_text(spec: GuidedSpec) -> str:
    """The llguidance grammar (its JSON or lark form) of `spec`; raises GrammarCompileError on a malformed spec."""
    import llguidance

    try:
        if spec.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(spec.spec, defaults=JSON_OPTIONS)
        if spec.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if spec.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.spec)
        if spec.kind == "choice":
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(_lark_string(c) for c in json.loads(spec.spec)))
        return llguidance.LLMatcher.grammar_from_lark(spec.spec)
    except (ValueError, TypeError) as exc:
        raise GrammarCompileError(f"invalid {spec.kind}: {exc}") from exc


class CompiledGrammar:
    """A compiled grammar: a fresh matcher that each new sequence copies."""

    def __init__(self, spec: GuidedSpec, template: Any) -> None:
        self.spec = spec
        self._template = template

    def matcher(self) -> Any:
        return self._template.deep_copy()


class GrammarCompiler:
    """Compiles GuidedSpecs against one tokenizer, with an LRU cache keyed by the spec. Safe from any thread (the
    server compiles in worker threads); the llguidance tokenizer (about a second to build) is built on first use."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._tokenizer: Any = None
        self._cache: OrderedDict[GuidedSpec, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def _llg_tokenizer(self) -> Any:
        if self._tokenizer is None:
            import llguidance
            import llguidance.hf

            hf_tokenizer = self._hf_tokenizer
            if isinstance(hf_tokenizer, ByteLevelTokenizer):  # llguidance takes transformers' class
                hf_tokenizer = hf_tokenizer.transformers
            self._tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=self.vocab_size,
                                                           eos_token=self._eos or None)
        return self._tokenizer

    def compile(self, spec: GuidedSpec) -> CompiledGrammar:
        """The compiled grammar of `spec` (cached); raises GrammarCompileError with llguidance's reason."""
        import llguidance

        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
            tokenizer = self._llg_tokenizer()
        grammar = grammar_text(spec)
        template = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if template.is_error():
            raise GrammarCompileError(f"cannot compile the {spec.kind}: {template.get_error()}")
        compiled = CompiledGrammar(spec, template)
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled



_BIT_VALUES = (1 << torch.arange(32, dtype=torch.int64)).to(torch.int32)  # bit j of a word; bit 31 is negative
_executor: list[Any] = []  # llguidance's LLExecutor, made on first use


def fill_bitmask(matchers: list[Any], vocab_size: int) -> torch.Tensor:
    """[len(matchers), ceil(vocab / 32)] int32: bit j of word w allows token 32 w + j, one row per matcher,
    computed in one executor call (llguidance's native threads, without the GIL)."""
    if not _executor:
        import llguidance

        _executor.append(llguidance.LLExecutor())
    words = (vocab_size + 31) // 32
    bitmask = torch.full((len(matchers), words), -1, dtype=torch.int32)
    _executor[0].unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(), words * 4,
                                         len(matchers))
    return bitmask


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: -inf on the tokens `bitmask` forbids, in the logits rows `rows` (tensor ops for the whole batch;
    in place when every row is constrained)."""
    vocab = logits.shape[1]
    dev = logits.device
    forbidden = ((bitmask.to(dev)[:, :, None] & _BIT_VALUES.to(dev)) == 0).flatten(1)[:, :vocab]
    if forbidden.shape[1] < vocab:  # logits wider than the grammar's vocabulary: the padding is never allowed
        forbidden = torch.nn.functional.pad(forbidden, (0, vocab - forbidden.shape[1]), value=True)
    if len(rows) == len(logits):
        logits.masked_fill_(forbidden, float("-inf"))
    else:
        logits[rows] = logits[rows].masked_fill(forbidden, float("-inf"))
