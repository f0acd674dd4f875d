"""Request and response schemas of the OpenAI API (chat, completions, models, usage).

Field names and shapes follow OpenAI's API reference and the official `openai` package's types.
The extra sampling fields `top_k`, `min_p`, `repetition_penalty`, `ignore_eos` and
`stop_token_ids` (and, for completions, `return_tokens_as_token_ids`) are accepted at the top
level of the body, as vLLM's OpenAI server accepts them (vllm/entrypoints/openai/protocol.py).
Structured output: `response_format` (json_object, json_schema) and vLLM's extras `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`; tools as OpenAI's (`tools`, `tool_choice`,
`parallel_tool_calls`, `tool` and assistant `tool_calls` messages).
Unknown fields are ignored, as vLLM does.
Features the engine does not have (suffix, best_of > n) are refused with a 400 instead of being
silently dropped.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

MAX_TOP_LOGPROBS = 20
SESSION_ID_PATTERN = r"^[A-Za-z0-9._:@-]{1,128}$"
# apply_chat_template's own arguments, which chat_template_kwargs must not override
RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tools", "documents", "chat_template",
                                      "add_generation_prompt", "continue_final_message", "tokenize", "padding",
                                      "truncation", "max_length", "return_tensors", "return_dict",
                                      "return_assistant_tokens_mask", "tokenizer_kwargs"})


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)  # NaN and inf: 400, as OpenAI


class StreamOptions(_Request):
    include_usage: bool | None = False


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCallIn(_Request):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # tool turns: the call they answer

    @model_validator(mode="after")
    def _check_content(self) -> ChatMessage:
        # as OpenAI's API: only an assistant turn (one that called tools, say) may come without content
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs 'content'")
        return self

    def text(self) -> str:
        """The message content as one string (text parts joined by newlines, as vLLM does)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class CompressDocument(BaseModel):
    id: Annotated[str, Field(min_length=1, max_length=256)]
    text: str


class ContextCompressionRequest(BaseModel):
    """glmserve extra (`context_compression`, and the body of POST /v1/compress): documents compressed by
    glmserve/compress/ to one of target_ratio / target_tokens / preset (default ratio 3.4)."""

    model_config = ConfigDict(extra="forbid")

    documents: Annotated[list[CompressDocument], Field(min_length=1, max_length=64)]
    query: str | None = None  # in a chat request: the last user message when unset
    target_ratio: float | None = None
    target_tokens: int | None = None
    preset: Literal["short", "medium", "long"] | None = None


class SparseAttentionRequest(BaseModel):
    """glmserve extra: this request's sparse decode attention (glmserve/sparse_settings.py); unset fields
    keep the server's defaults, the engine validates the values (400 with the reason)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    mode: Literal["dense", "block", "learned", "native"] | None = None
    top_k: int | None = None
    threshold: float | None = None
    sink_tokens: int | None = None
    local_tokens: int | None = None
    observe_tokens: int | None = None


class SamplingRequest(_Request):
    """Fields shared by chat and text completions."""

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=128)] = 1
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None  # OpenAI's tags; written to the interaction log (--log-interactions)
    # extras accepted as vLLM accepts them
    top_k: int | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    sparse_attention: SparseAttentionRequest | None = None  # glmserve extra
    # session KV persistence (glmserve/kv/session_store.py); the X-Session-Id header is the alternative
    session_id: Annotated[str, Field(pattern=SESSION_ID_PATTERN)] | None = None
    # structured output as vLLM's extras (glmserve/engine/structured.py)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @model_validator(mode="after")
    def _check_common(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        for token, bias in (self.logit_bias or {}).items():
            if not token.isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {token!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        if len(self.guided_fields()) > 1:
            raise ValueError(f"only one of {', '.join(self.guided_fields())} may be given")
        if self.top_k is not None and self.top_k < -1:
            raise ValueError("top_k must be -1 or 0 (disabled) or a positive integer")
        return self

    def guided_fields(self) -> list[str]:
        """The structured-output fields the client set."""
        return [name for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
                if getattr(self, name) is not None]

    def sparse_overrides(self) -> dict[str, Any] | None:
        """The sparse settings the client gave (None: the server's default)."""
        return None if self.sparse_attention is None else self.sparse_attention.model_dump(exclude_none=True)

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class JsonSchemaFormat(_Request):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type 'json_schema' needs a 'json_schema' object")
        return self


class FunctionDefinition(_Request):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    response_format: ResponseFormat | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # with a session: replace earlier turns by a summary the model writes (glmserve/server/anchoring.py)
    session_summary: bool = False
    # glmserve extra: documents compressed before prefill (glmserve/server/compress_routes.py)
    context_compression: ContextCompressionRequest | None = None
    # extra chat-template variables, as vLLM and SGLang accept them (e.g. {"enable_thinking": false})
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise ValueError("tool function names must be unique")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice 'required' or a named function needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names function {self.tool_choice.function.name!r}, which is not in tools")
        constrained = self.guided_fields() + (["response_format"] if self.json_format() else [])
        if self.forces_tool_call():
            constrained.append("tool_choice")
        if len(constrained) > 1:
            raise ValueError(f"only one of {', '.join(constrained)} may constrain the output")
        reserved = sorted(set(self.chat_template_kwargs or ()) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}")
        return self

    def json_format(self) -> bool:
        return self.response_format is not None and self.response_format.type != "text"

    def active_tools(self) -> list[ToolDefinition]:
        """The tools the model may call: none with tool_choice 'none', only the named one for a named choice."""
        if not self.tools or self.tool_choice == "none":
            return []
        if isinstance(self.tool_choice, NamedToolChoice):
            return [t for t in self.tools if t.function.name == self.tool_choice.function.name]
        return list(self.tools)

    def parallel_calls(self) -> bool:
        """Whether a choice may make several calls: parallel_tool_calls, and never for a named function (one call
        of it, as OpenAI's forced function)."""
        return self.parallel_tool_calls and not isinstance(self.tool_choice, NamedToolChoice)

    def forces_tool_call(self) -> bool:
        """tool_choice 'required' or a named function: the output is constrained to a call."""
        return bool(self.tools) and (self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice))

    def token_limit(self) -> int | None:
        """max_completion_tokens, or the older max_tokens."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        """Engine logprobs setting: None, or how many alternatives per token."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def num_prompt_logprobs(self) -> None:
        return None  # chat has no echo


PromptInput = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingRequest):
    prompt: PromptInput
    # OpenAI's default for completions; 0 with echo scores the prompt only (lm-evaluation-harness' loglikelihood)
    max_tokens: Annotated[int, Field(ge=0)] | None = 16
    echo: bool | None = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None
    # vLLM extra: logprob tokens as "token_id:ID" (distinct tokens that decode to the same text stay distinct)
    return_tokens_as_token_ids: bool = False

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix is not supported by this server")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of different from n is not supported by this server")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be empty")
        if isinstance(self.prompt, list) and any(isinstance(p, list) and not p for p in self.prompt):
            raise ValueError("token-id prompts must not be empty")
        return self

    def token_limit(self) -> int | None:
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def num_prompt_logprobs(self) -> int | None:
        """With echo, logprobs scores the echoed prompt too."""
        return self.logprobs if self.echo else None

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: strings or token-id lists."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if all(isinstance(p, int) for p in self.prompt):
            return [list(self.prompt)]  # one token-id prompt
        return list(self.prompt)


# ---------------------------------------------------------------------- responses


def _now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # of the completion tokens, those in the reasoning part (a reasoning parser's)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails = Field(default_factory=CompletionTokensDetails)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None
    refusal: list[TokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None  # with a reasoning parser (glmserve/server/reasoning.py), as vLLM
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None


FinishReason = Literal["stop", "length", "tool_calls"]


class _Sparse(BaseModel):
    """Only the fields a chunk sets are sent."""

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class FunctionCallDelta(_Sparse):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_Sparse):
    """A streamed tool call: its first delta has id, type and name (arguments ""), later ones argument text."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ChatCompletionWithTrace(ChatCompletionResponse):
    """A chat completion of a request with `context_compression`: the trace map beside the answer."""

    context_compression: dict[str, Any]


class ChoiceDelta(_Sparse):
    """Only the fields a chunk sets are sent (`{"content": "..."}`, `{}` with the finish reason)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChoiceDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ChatCompletionChunkWithTrace(ChatCompletionChunk):
    """The extra chunk of a streamed request with `context_compression` (no choices): the trace map, sent
    after every choice's finish chunk and before the usage chunk."""

    context_compression: dict[str, Any]


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class CompletionResponse(BaseModel):
    """Both the whole response and each streamed chunk (OpenAI uses one shape for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "glmserve"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
