"""What the request handlers share: the engine, metrics, config, and model-dependent helpers.

The model loads in the background after the server starts listening; the parts that need it
(alias table, tokenizer helpers) are built by an engine hook as soon as it is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from glmserve.engine.async_engine import AsyncEngine, EngineState
from glmserve.engine.llm_engine import LLMEngine
from glmserve.engine.structured import CompiledGrammar, GuidedSpec
from glmserve.server.aliases import AliasTable
from glmserve.server.chat_turns import template_turns
from glmserve.server.config import ServerConfig
from glmserve.server.errors import BadRequestError, ServiceUnavailableError
from glmserve.server.interactions import Interactions
from glmserve.server.logprobs import TokenFormatter
from glmserve.server.metrics import ServerMetrics
from glmserve.server.protocol import ChatMessage, ToolDefinition
from glmserve.server.reasoning import ReasoningParser, reasoning_parser
from glmserve.server.tool_parsers import ToolParser, detect_tool_parser, tool_parser


class ServedModel:
    """The model this server serves, as the handlers use it: aliases, tokenization, token formatting
    (built once the engine has loaded it)."""

    def __init__(self, engine: LLMEngine, aliases: dict[str, str], tool_call_parser: str = "auto",
                 reasoning: str | None = None) -> None:
        self._engine = engine
        self.tokenizer = engine.tokenizer  # the served model's (glmserve/compress counts tokens with it)
        self.aliases = AliasTable(engine.model_name, aliases)
        self.formatter = TokenFormatter(engine.tokenizer)
        self.max_model_len: int = engine.max_model_len
        self._chat_template: str | None = getattr(engine.tokenizer, "chat_template", None)
        self.tool_parser: ToolParser = tool_parser(
            detect_tool_parser(self._chat_template) if tool_call_parser == "auto" else tool_call_parser)
        self.reasoning_parser: ReasoningParser | None = reasoning_parser(reasoning)

    def chat_prompt(self, messages: list[ChatMessage], tools: list[ToolDefinition] | None = None,
                    template_kwargs: dict | None = None) -> list[int]:
        """Token ids of the conversation (with the tools the model may call) and the generation prompt."""
        turns, template_tools = template_turns(messages, tools or [], self._chat_template)
        try:
            return list(self._engine.apply_chat_template(turns, template_tools, template_kwargs))
        except Exception as exc:  # a template may reject an ordering of roles, for instance
            raise BadRequestError(f"The chat template rejected the messages: {exc}", param="messages") from exc

    def compile_grammar(self, spec: GuidedSpec) -> CompiledGrammar:
        """Compiles (or finds in the cache) the grammar of `spec`; blocking, so handlers run it in a worker thread.
        Raises GrammarCompileError with the reason."""
        return self._engine.grammars.compile(spec)

    def encode(self, text: str) -> list[int]:
        """Token ids of a completion prompt, tokenized exactly as the engine would."""
        return self._engine.tokenize(text)

    def decode(self, token_ids: list[int]) -> str:
        return self._engine.tokenizer.decode(token_ids)


@dataclass
class ServingContext:
    engine: AsyncEngine
    metrics: ServerMetrics
    config: ServerConfig
    interactions: Interactions | None = None  # --log-interactions
    _loaded: ServedModel | None = field(default=None, init=False)

    def on_engine_loaded(self, engine: LLMEngine) -> None:
        """Engine hook: build the model helpers (a bad alias fails startup here)."""
        self._loaded = ServedModel(engine, self.config.aliases, self.config.tool_call_parser,
                                   self.config.reasoning_parser)

    def count_tokens(self, text: str) -> int | None:
        """Tokens of `text` for the gateway's admission (None until the model is loaded)."""
        return len(self._loaded.encode(text)) if self._loaded is not None else None

    def loaded(self) -> ServedModel:
        """The model helpers; 503 while the model is loading or after the engine stopped."""
        if self._loaded is None or self.engine.state is not EngineState.READY:
            raise ServiceUnavailableError(
                self.engine.failure or f"The model is not ready (state: {self.engine.state.value}).",
                code="model_not_ready",
            )
        return self._loaded
