"""Structured output, tool calls and logit_bias end to end: a real `glmserve serve` process on the embedded
SmolLM2, driven by the official `openai` client; outputs checked with the `jsonschema` package.

The slow test runs the shipped schema suite (tests/data/schemas/) and prints the validity and the share llguidance
cannot compile (each of those gets a 400 that says why).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from enum import Enum
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from server_process import STARTUP_TIMEOUT_S, ServerProcess, glmserve_process, wait_for

SERVED = "smollm2"
SCHEMAS = Path(__file__).parent / "data" / "schemas"
ASK = [{"role": "user", "content": "Describe a small invoice as JSON."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
                                       "required": ["zone"], "additionalProperties": False}}}
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log_path = tmp_path_factory.mktemp("structured") / "server.log"
    args = ["--served-model-name", SERVED, "--max-model-len", "1024", "--kv-cache-memory-bytes", str(64 << 20),
            "--num-threads", "1", "--shutdown-timeout", "10", "--quantization", "none"]
    with glmserve_process(args, log_path) as process, httpx.Client(base_url=process.base_url, timeout=30) as http:
        wait_for(lambda: http.get("/v1/health").status_code == 200, STARTUP_TIMEOUT_S, "readiness", process.log)
        yield process


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


class Currency(str, Enum):
    EUR = "EUR"
    USD = "USD"


class Line(BaseModel):
    description: str = Field(max_length=20)
    quantity: int = Field(ge=1, le=9)


class Invoice(BaseModel):
    number: str = Field(pattern=r"^INV-[0-9]{3}$")
    currency: Currency
    lines: list[Line] = Field(min_length=1, max_length=2)
    paid: bool


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(model=SERVED, messages=ASK, response_format=Invoice, n=2,
                                               temperature=1.0, seed=3, max_tokens=160)
    for choice in completion.choices:
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, Invoice)  # the client validated it against the pydantic model


def test_json_object_streamed_with_a_stop_string(client: openai.OpenAI) -> None:
    copy = [{"role": "user", "content": 'Repeat this JSON object exactly: {"name": "Bob", "age": 42}'}]
    request = dict(model=SERVED, messages=copy, response_format={"type": "json_object"}, max_tokens=40, temperature=0)
    whole = client.chat.completions.create(**request)
    assert whole.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(whole.choices[0].message.content), dict)
    stream = client.chat.completions.create(**request, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream) == whole.choices[0].message.content
    cut = client.chat.completions.create(**request, stop=[","])
    assert cut.choices[0].finish_reason == "stop"
    assert whole.choices[0].message.content.startswith(cut.choices[0].message.content + ",")


def test_guided_choice_and_regex(client: openai.OpenAI) -> None:
    choices = ["positive", "negative", "neutral"]
    answer = client.chat.completions.create(
        model=SERVED, messages=[{"role": "user", "content": "Sentiment of 'I love it'?"}], n=3, temperature=1.0,
        max_tokens=10, extra_body={"guided_choice": choices})
    assert all(c.message.content in choices for c in answer.choices)
    dated = client.completions.create(model=SERVED, prompt="Today's date is", max_tokens=20, temperature=1.0, n=2,
                                      extra_body={"guided_regex": r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"})
    for c in dated.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(c.text, {"type": "string", "pattern": r"^20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]$"})


def test_a_schema_that_cannot_compile_is_400(client: openai.OpenAI, server: ServerProcess) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=SERVED, messages=ASK, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "tags", "strict": True, "schema": {
                "type": "array", "items": {"type": "string"}, "uniqueItems": True}}})
    assert "uniqueItems" in info.value.message and info.value.param == "response_format"
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        bad_regex = http.post("/v1/completions", json={"model": SERVED, "prompt": "x", "guided_regex": "(a"})
        both = http.post("/v1/completions", json={"model": SERVED, "prompt": "x", "guided_regex": "a",
                                                  "guided_choice": ["a"]})
    assert bad_regex.status_code == 400 and bad_regex.json()["error"]["param"] == "guided_regex"
    assert both.status_code == 400 and "only one of" in both.json()["error"]["message"]


def _check_weather_call(call: object) -> dict:
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    return arguments


def test_required_tool_call_whole_and_streamed(client: openai.OpenAI) -> None:
    request = dict(model=SERVED, messages=WEATHER_ASK, tools=[WEATHER, TIME], tool_choice="required",
                   parallel_tool_calls=False, temperature=0, max_tokens=80)
    whole = client.chat.completions.create(**request)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    arguments = _check_weather_call(choice.message.tool_calls[0]) if (
        choice.message.tool_calls[0].function.name == "get_weather") else None
    chunks = list(client.chat.completions.create(**request, stream=True))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
    first = deltas[0]  # as OpenAI sends it: id, type and name first, with empty arguments
    assert first.id and first.type == "function" and first.function.name and first.function.arguments == ""
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    streamed = "".join(d.function.arguments for d in deltas[1:])
    assert first.function.name == choice.message.tool_calls[0].function.name
    assert json.loads(streamed) == json.loads(choice.message.tool_calls[0].function.arguments)
    if arguments is not None:
        assert json.loads(streamed) == arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


@pytest.mark.slow
def test_auto_tool_choice_reads_the_call_the_model_writes(client: openai.OpenAI) -> None:
    """With `auto` the model may call or answer: here it writes a call (forced by a guided_regex of the call's text,
    so it does not depend on the model), which is read into tool_calls, whole and streamed; with `none` the same
    text stays content."""
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    request = dict(model=SERVED, messages=WEATHER_ASK, tools=[WEATHER, TIME], temperature=0, max_tokens=60,
                   extra_body={"guided_regex": call.replace("{", r"\{").replace("}", r"\}")})
    whole = client.chat.completions.create(**request, tool_choice="auto").choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    assert _check_weather_call(whole.message.tool_calls[0]) == {"city": "Paris", "unit": "celsius"}
    chunks = list(client.chat.completions.create(**request, stream=True))  # auto is the default with tools
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
    assert deltas[0].id and deltas[0].function.name == "get_weather" and deltas[0].function.arguments == ""
    assert json.loads("".join(d.function.arguments for d in deltas[1:])) == {"city": "Paris", "unit": "celsius"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    none = client.chat.completions.create(**request, tool_choice="none").choices[0]
    assert none.finish_reason == "stop" and none.message.tool_calls is None and none.message.content == call


def test_named_tool_call_and_round_trip(client: openai.OpenAI) -> None:
    named = client.chat.completions.create(model=SERVED, messages=WEATHER_ASK, tools=[WEATHER, TIME], n=2,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           temperature=0, max_tokens=80)
    for choice in named.choices:
        assert choice.finish_reason == "tool_calls"
        assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
        _check_weather_call(choice.message.tool_calls[0])
    call = named.choices[0].message.tool_calls[0]
    follow_up = WEATHER_ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'}]
    answer = client.chat.completions.create(model=SERVED, messages=follow_up, tools=[WEATHER], tool_choice="none",
                                            temperature=0, max_tokens=20)
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].finish_reason in ("stop", "length")
    plain = client.chat.completions.create(model=SERVED, messages=WEATHER_ASK, max_tokens=1)
    assert answer.usage.prompt_tokens > plain.usage.prompt_tokens + 20  # the call and its result are in the prompt


def test_logit_bias(client: openai.OpenAI) -> None:
    request = dict(model=SERVED, prompt="The capital of France is", max_tokens=4, temperature=0, logprobs=1)
    plain = client.completions.create(**request)
    first = plain.choices[0].logprobs.tokens[0]
    token_id = client.completions.create(**request, extra_body={"return_tokens_as_token_ids": True}
                                         ).choices[0].logprobs.tokens[0].split(":")[1]
    banned = client.completions.create(**request, logit_bias={token_id: -100})
    assert banned.choices[0].logprobs.tokens[0] != first
    forced = client.completions.create(**request, logit_bias={token_id: 100})
    assert forced.choices[0].logprobs.tokens == [first] * 4


@pytest.mark.slow
def test_schema_suite_validity(client: openai.OpenAI) -> None:
    """Every shipped schema either compiles and then always validates (n=2, temperature 1), or gets a 400."""
    valid = total = refused = 0
    for path in sorted(SCHEMAS.glob("*.json")):
        schema = json.loads(path.read_text())
        prompt = [{"role": "user", "content": f"Give an example of a {path.stem.replace('_', ' ')} as JSON."}]
        try:
            answer = client.chat.completions.create(model=SERVED, messages=prompt, n=2, temperature=1.0, seed=0,
                                                    max_tokens=400, response_format={"type": "json_schema",
                                                    "json_schema": {"name": path.stem, "schema": schema,
                                                                    "strict": True}})
        except openai.BadRequestError as exc:
            refused += 1
            print(f"{path.stem}: refused: {exc.message}")
            continue
        for choice in answer.choices:
            total += 1
            try:
                jsonschema.validate(json.loads(choice.message.content), schema)
                valid += choice.finish_reason == "stop"
            except (ValueError, jsonschema.ValidationError) as exc:
                print(f"{path.stem}: invalid ({choice.finish_reason}): {exc}")
    count = len(list(SCHEMAS.glob("*.json")))
    print(f"schema suite: {valid}/{total} outputs valid; {refused}/{count} schemas refused by llguidance")
    assert valid == total
