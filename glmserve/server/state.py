"""What the request handlers share: the engine, metrics, config, and model-dependent helpers.

The model loads in the background after the server starts listening; the parts that need it
(alias table, tokenizer helpers) are built by an engine hook as soon as it is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from glmserve.engine.async_engine import AsyncEngine, EngineState
from glmserve.engine.llm_engine import LLMEngine
from glmserve.server.aliases import AliasTable
from glmserve.server.config import ServerConfig
from glmserve.server.errors import BadRequestError, ServiceUnavailableError
from glmserve.server.logprobs import TokenFormatter
from glmserve.server.metrics import ServerMetrics
from glmserve.server.protocol import ChatMessage


class ServedModel:
    """The model this server serves, as the handlers use it: aliases, tokenization, token formatting
    (built once the engine has loaded it)."""

    def __init__(self, engine: LLMEngine, aliases: dict[str, str]) -> None:
        self._engine = engine
        self.aliases = AliasTable(engine.model_name, aliases)
        self.formatter = TokenFormatter(engine.tokenizer)
        self.max_model_len: int = engine.max_model_len

    def chat_prompt(self, messages: list[ChatMessage]) -> list[int]:
        """Token ids of the conversation with the generation prompt appended."""
        turns = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]
        try:
            return list(self._engine.apply_chat_template(turns))
        except Exception as exc:  # a template may reject an ordering of roles, for instance
            raise BadRequestError(f"The chat template rejected the messages: {exc}", param="messages") from exc

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
    _loaded: ServedModel | None = field(default=None, init=False)

    def on_engine_loaded(self, engine: LLMEngine) -> None:
        """Engine hook: build the model helpers (a bad alias fails startup here)."""
        self._loaded = ServedModel(engine, self.config.aliases)

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
