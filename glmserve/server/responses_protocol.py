"""Schemas of OpenAI's Responses API (POST /v1/responses) as far as glmserve serves it.

Field names and shapes follow OpenAI's API reference and the official `openai` package's types
(openai/types/responses/): input as text or a list of items (messages, `function_call`, `function_call_output`;
`reasoning` items are accepted and left out of the prompt), `instructions`, function tools, `tool_choice`,
`text.format`, `previous_response_id`, `store`, `stream`, `include` (`message.output_text.logprobs`) and
`top_logprobs`; the chat extras `seed`, `top_k`, `chat_template_kwargs`, `session_id` and vLLM's `guided_*` fields.
Built-in tools (web search, files, ...) and non-text content are refused with a 400. Unknown fields are ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from glmserve.server.protocol import SESSION_ID_PATTERN


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class InputText(_Request):
    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(_Request):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)


class FunctionCallItem(_Request):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Request):
    type: Literal["function_call_output"]
    call_id: str
    output: str


class ReasoningItem(_Request):
    type: Literal["reasoning"]


def _item_kind(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "message")
    return kind if kind in ("message", "function_call", "function_call_output", "reasoning") else "unsupported"


class UnsupportedItem(_Request):
    type: str

    @model_validator(mode="after")
    def _refuse(self) -> UnsupportedItem:
        raise ValueError(f"input items of type {self.type!r} are not supported by this server")


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")]
    | Annotated[UnsupportedItem, Tag("unsupported")],
    Discriminator(_item_kind),
]


class FunctionTool(_Request):
    type: str
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")] | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _check(self) -> FunctionTool:
        if self.type != "function":
            raise ValueError(f"tools of type {self.type!r} are not supported by this server (only 'function')")
        if self.name is None:
            raise ValueError("a function tool needs a name")
        return self


class FunctionToolChoice(_Request):
    type: Literal["function"]
    name: str


class TextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Request):
    format: TextFormat | None = None


# OpenAI's `include` values (openai/types/responses/response_includable.py); the others name items of built-in
# tools or images, which this server refuses anyway, so they include nothing
INCLUDE_LOGPROBS = "message.output_text.logprobs"
INCLUDABLE = ("file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
              "message.input_image.image_url", "computer_call_output.output.image_url",
              "code_interpreter_call.outputs", "reasoning.encrypted_content", INCLUDE_LOGPROBS)


class ResponsesRequest(_Request):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: list[str] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None  # alternatives per token, with INCLUDE_LOGPROBS
    # glmserve / vLLM extras, as on chat completions
    seed: int | None = None
    top_k: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    session_id: Annotated[str, Field(pattern=SESSION_ID_PATTERN)] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @model_validator(mode="after")
    def _check_include(self) -> ResponsesRequest:
        for value in self.include or ():
            if value not in INCLUDABLE:
                raise ValueError(f"unknown include value {value!r}; expected one of {', '.join(INCLUDABLE)}")
            if value == "reasoning.encrypted_content":
                raise ValueError("include 'reasoning.encrypted_content' is not supported by this server (reasoning "
                                 "is returned as text; use store and previous_response_id to continue)")
        return self

    def logprobs(self) -> int | None:
        """None: no logprobs; else the alternatives per token (message.output_text.logprobs included)."""
        return (self.top_logprobs or 0) if INCLUDE_LOGPROBS in (self.include or ()) else None


# ---------------------------------------------------------------------- output


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


Status = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str = Field(default_factory=lambda: item_id("msg"))
    role: Literal["assistant"] = "assistant"
    status: Status = "in_progress"
    content: list[OutputText] = Field(default_factory=list)


class OutputReasoning(BaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str = Field(default_factory=lambda: item_id("rs"))
    status: Status = "in_progress"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str = Field(default_factory=lambda: item_id("fc"))
    call_id: str
    name: str
    arguments: str = ""
    status: Status = "in_progress"


OutputItem = OutputMessage | OutputReasoning | OutputFunctionCall


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: float = Field(default_factory=time.time)
    completed_at: float | None = None
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"
    error: None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    store: bool = True
    temperature: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_logprobs: int | None = None
    top_p: float | None = None
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
