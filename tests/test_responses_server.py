"""The Responses API, reasoning content and the frameworks' helpers end to end: a real `glmserve serve` process
on the embedded SmolLM2 (with `--reasoning-parser glm45` and a session store in a temporary directory), driven by
the official `openai` client (`responses.create` / `.stream` / `.parse`, `chat.completions.stream`) and LangChain's
`ChatOpenAI` (`bind_tools`, `with_structured_output(method="json_schema")`). The tool-call, text-format and framework
tests are slow (several constrained answers each); the item and event logic they rely on is tested fast in
tests/test_reasoning.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from server_process import STARTUP_TIMEOUT_S, ServerProcess, glmserve_process, wait_for

SERVED = "smollm2"
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": WEATHER_PARAMS}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
THINKING = r"<think>[a-z]{1,6}( [a-z]{1,6}){0,2}\.</think>\n[A-Z][a-z]{1,6}( [a-z]{1,6})?\."


@contextmanager
def _serving(sessions: Path, log: Path) -> Iterator[ServerProcess]:
    """`glmserve serve` with the glm45 reasoning parser and its session store in `sessions`, once ready."""
    args = ["--served-model-name", SERVED, "--max-model-len", "1024", "--kv-cache-memory-bytes", str(64 << 20),
            "--num-threads", "1", "--shutdown-timeout", "10", "--quantization", "none",
            "--reasoning-parser", "glm45", "--session-store", str(sessions)]
    with glmserve_process(args, log) as process, httpx.Client(base_url=process.base_url, timeout=30) as http:
        wait_for(lambda: http.get("/v1/health").status_code == 200, STARTUP_TIMEOUT_S, "readiness", process.log)
        yield process


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("responses")
    with _serving(root / "sessions", root / "server.log") as process:
        yield process


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_text_input_whole_and_streamed(client: openai.OpenAI) -> None:
    question = [{"type": "input_text", "text": "What is the capital of France?"}]
    request = dict(model=SERVED, instructions="Answer in one short sentence.", temperature=0, max_output_tokens=12,
                   input=[{"role": "user", "content": question}])
    whole = client.responses.create(**request)
    assert whole.object == "response" and whole.id.startswith("resp_") and whole.output_text
    assert whole.usage.output_tokens <= 12 and whole.usage.input_tokens > 10
    if whole.status == "incomplete":
        assert whole.usage.output_tokens == 12 and whole.incomplete_details.reason == "max_output_tokens"
    events = list(client.responses.create(**request, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{whole.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == whole.output_text == events[-1].response.output_text
    longer = client.responses.create(**{**request, "instructions": request["instructions"] * 3, "max_output_tokens": 1})
    assert longer.usage.input_tokens > whole.usage.input_tokens + 10  # the instructions are in the prompt


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)


@pytest.mark.slow
def test_parse_and_stream_with_a_text_format(client: openai.OpenAI) -> None:
    ask = dict(model=SERVED, input="Name a large city as JSON.", temperature=0, max_output_tokens=60)
    parsed = client.responses.parse(**ask, text_format=City)
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, City)
    with client.responses.stream(**ask, text_format=City) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.output_parsed == parsed.output_parsed and "".join(deltas) == parsed.output_text


def test_previous_response_id_continues_in_the_session(client: openai.OpenAI, server: ServerProcess) -> None:
    first_raw = client.responses.with_raw_response.create(
        model=SERVED, instructions="You are terse.", temperature=0, max_output_tokens=8,
        input="My name is Alice and I live in Lyon, a city in France. " * 4)
    first, session = first_raw.parse(), first_raw.headers["x-session-id"]
    second = client.responses.create(model=SERVED, instructions="You are terse.", previous_response_id=first.id,
                                     input="Where do I live?", temperature=0, max_output_tokens=8)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens  # the history is in
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // 2
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        info = http.get(f"/v1/sessions/{session}").json()
    assert info["turns"] == 2 and info["num_tokens"] >= second.usage.input_tokens // 2
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as info_:
        client.responses.create(model=SERVED, previous_response_id=first.id, input="Hello?")
    assert info_.value.code == "previous_response_not_found"
    unstored = client.responses.create(model=SERVED, input="Hi", max_output_tokens=1, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.slow
def test_a_stored_response_continues_after_a_restart(tmp_path: Path) -> None:
    """A stored response outlives its server: the next server on the same session store continues the
    conversation from it, with the first turn's KV read back from the store (cached tokens)."""
    turn = dict(model=SERVED, instructions="You are terse.", temperature=0, max_output_tokens=8)
    with _serving(tmp_path / "sessions", tmp_path / "first.log") as process:
        client = openai.OpenAI(base_url=f"{process.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
        first = client.responses.create(**turn, input="My name is Alice and I live in Lyon, a city in France. " * 4)
    with _serving(tmp_path / "sessions", tmp_path / "second.log") as process:  # the first got SIGTERM, exited 0
        client = openai.OpenAI(base_url=f"{process.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
        assert client.responses.retrieve(first.id).output_text == first.output_text
        second = client.responses.create(**turn, previous_response_id=first.id, input="Where do I live?")
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens  # the history is in
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // 2


@pytest.mark.slow
def test_function_tools_whole_streamed_and_answered(client: openai.OpenAI) -> None:
    request = dict(model=SERVED, input="What is the weather in Paris?", tools=[WEATHER], tool_choice="required",
                   parallel_tool_calls=False, temperature=0, max_output_tokens=80)
    whole = client.responses.create(**request)
    calls = [i for i in whole.output if i.type == "function_call"]
    assert whole.status == "completed" and len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER_PARAMS)
    with client.responses.stream(**request) as stream:
        events = list(stream)
        final = stream.get_final_response()
    streamed = [i for i in final.output if i.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in streamed] == [(c.name, json.loads(c.arguments)) for c in calls]
    fragments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert fragments == streamed[0].arguments
    assert [e.arguments for e in events if e.type == "response.function_call_arguments.done"] == [fragments]
    answer = client.responses.create(
        model=SERVED, previous_response_id=whole.id, tools=[WEATHER], tool_choice="none", temperature=0,
        max_output_tokens=20, input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                      "output": '{"temperature": 21, "sky": "clear"}'}])
    assert answer.output_text and not [i for i in answer.output if i.type == "function_call"]
    plain = client.responses.create(model=SERVED, input=request["input"], max_output_tokens=1)
    assert answer.usage.input_tokens > plain.usage.input_tokens + 20  # the call and its result are in the prompt
    with pytest.raises(openai.BadRequestError, match="not supported"):
        client.responses.create(model=SERVED, input="x", tools=[{"type": "web_search"}])


def _thinking_tokens(tokens: list[str], reasoning: str) -> int:
    """Of an output's tokens (their texts, which join to `<think>REASONING</think>...`), those that hold reasoning
    text."""
    starts = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    span = (len("<think>"), len("<think>") + len(reasoning))
    return sum(s < span[1] and s + len(t) > span[0] for s, t in zip(starts, tokens))


def test_reasoning_content_whole_streamed_and_switched_off(client: openai.OpenAI) -> None:
    request = dict(model=SERVED, messages=[{"role": "user", "content": "Is the sky blue? Think first."}],
                   temperature=0, max_tokens=30)
    whole = client.chat.completions.create(**request, logprobs=True, extra_body={"guided_regex": THINKING})
    message = whole.choices[0].message
    assert message.reasoning_content and "<think>" not in message.content and "think>" not in message.reasoning_content
    assert message.content[0].isupper() and message.content.endswith(".")
    tokens = [t.token for t in whole.choices[0].logprobs.content]
    thinking = whole.usage.completion_tokens_details.reasoning_tokens
    assert thinking == _thinking_tokens(tokens, message.reasoning_content) and 0 < thinking < len(tokens) - 3
    chunks = list(client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"guided_regex": THINKING}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == message.reasoning_content
    assert "".join(d.content or "" for d in deltas) == message.content
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == thinking
    off = client.chat.completions.create(**request, extra_body={"guided_regex": THINKING,
                                                                "chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].message.reasoning_content is None and off.choices[0].message.content.startswith("<think>")
    assert off.usage.completion_tokens_details.reasoning_tokens == 0
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs"):
        client.chat.completions.create(**request, extra_body={"chat_template_kwargs": {"tokenize": False}})


def test_responses_reasoning_tokens_and_message_logprobs(client: openai.OpenAI) -> None:
    """The chat test's request as a response: the same thinking, counted alike; the message's logprobs (with 2
    alternatives each) are its own tokens', not the reasoning's, and the stream's text deltas carry them all."""
    request = dict(model=SERVED, input="Is the sky blue? Think first.", temperature=0, max_output_tokens=30,
                   include=["message.output_text.logprobs"], top_logprobs=2, extra_body={"guided_regex": THINKING})
    chat = client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": request["input"]}],
                                          temperature=0, max_tokens=30, extra_body={"guided_regex": THINKING})
    whole = client.responses.create(**request)
    assert [i.type for i in whole.output] == ["reasoning", "message"] and whole.top_logprobs == 2
    assert whole.output[0].content[0].text == chat.choices[0].message.reasoning_content
    assert whole.usage.output_tokens_details.reasoning_tokens == chat.usage.completion_tokens_details.reasoning_tokens
    logprobs = whole.output[1].content[0].logprobs
    assert "".join(lp.token for lp in logprobs).lstrip("\n") == whole.output_text == chat.choices[0].message.content
    assert all(len(lp.top_logprobs) == 2 and lp.top_logprobs[0].logprob >= lp.logprob - 1e-4 for lp in logprobs)
    events = list(client.responses.create(**request, stream=True))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [(lp.token, lp.logprob) for lp in streamed] == [(lp.token, lp.logprob) for lp in logprobs]
    assert events[-1].response.usage.output_tokens_details.reasoning_tokens > 0
    plain = client.responses.create(model=SERVED, input=request["input"], max_output_tokens=3, top_logprobs=2)
    assert plain.output[-1].content[0].logprobs == []
    with pytest.raises(openai.BadRequestError, match="include"):
        client.responses.create(model=SERVED, input="Hi", include=["message.output_text.everything"])


@pytest.mark.slow
def test_chat_stream_helper_with_tool_calls(client: openai.OpenAI) -> None:
    with client.chat.completions.stream(model=SERVED, messages=[{"role": "user", "content": "Weather in Rome?"}],
                                        tools=[CHAT_WEATHER], tool_choice="required", parallel_tool_calls=False,
                                        temperature=0, max_tokens=80) as stream:
        done = [e for e in stream if e.type == "tool_calls.function.arguments.done"]
        final = stream.get_final_completion()
    call = final.choices[0].message.tool_calls[0]
    assert final.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert [(e.name, e.arguments) for e in done] == [("get_weather", call.function.arguments)]
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMS)


@pytest.mark.slow
def test_langchain_bind_tools_and_structured_output(server: ServerProcess) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", model=SERVED,
                                      temperature=0, max_tokens=80, max_retries=0, timeout=300)

    def get_weather(city: str, unit: str) -> str:
        """Current weather in a city (unit: celsius or fahrenheit)."""
        return f"21 {unit} in {city}"

    called = llm.bind_tools([get_weather], tool_choice="required", parallel_tool_calls=False).invoke(
        "What is the weather in Paris?")
    assert [c["name"] for c in called.tool_calls] == ["get_weather"]
    assert set(called.tool_calls[0]["args"]) == {"city", "unit"}
    city = llm.with_structured_output(City, method="json_schema").invoke("Name a large city.")
    assert isinstance(city, City)
