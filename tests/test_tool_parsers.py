"""Tool-call parsers (glmserve/server/tool_parsers.py) and their streams (tool_stream.py): each family's output
read whole and streamed character by character gives the same calls; each forcing grammar compiles with
llguidance on the embedded tokenizer and accepts the family's own call text."""

from __future__ import annotations

import json

import pytest

from glmserve.engine.structured import GrammarCompiler, GuidedSpec
from glmserve.server.protocol import ToolDefinition
from glmserve.server.tool_parsers import detect_tool_parser, tool_parser
from glmserve.server.tool_stream import ToolCalls

TOOLS = [ToolDefinition.model_validate({"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city", "days"]}}}),
    ToolDefinition.model_validate({"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}})]

OUTPUTS = {
    "hermes": ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'),
    "llama3_json": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
                    '{"name": "get_time", "parameters": {"zone": "CET"}}'),
    "glm45": ("Let me check.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
              "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"
              "<tool_call>get_time\n<arg_key>zone</arg_key>\n<arg_value>CET</arg_value>\n</tool_call>"),
}
EXPECTED = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": "CET"})]


def _streamed(calls: ToolCalls, text: str) -> tuple[str, dict[int, dict]]:
    """Feeds `text` one character at a time; returns the content and the calls the deltas reassemble to."""
    content, assembled = "", {}
    for end in range(1, len(text) + 1):
        delta, tool_deltas = calls.deltas(text[:end], final=end == len(text))
        content += delta
        for d in tool_deltas:
            if d.id is not None:  # a call's first delta: id, type and name, arguments ""
                assert d.index not in assembled and d.type == "function" and d.function.arguments == ""
                assembled[d.index] = {"name": d.function.name, "arguments": ""}
            else:
                assert d.function.name is None
                assembled[d.index]["arguments"] += d.function.arguments
    return content, assembled


@pytest.mark.parametrize("family", OUTPUTS)
def test_whole_and_streamed_calls_agree(family: str) -> None:
    text = OUTPUTS[family]
    content, calls = ToolCalls(tool_parser(family), TOOLS, parallel=True).message(text)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == EXPECTED
    assert content == (None if family == "llama3_json" else "Let me check.")
    streamed_content, assembled = _streamed(ToolCalls(tool_parser(family), TOOLS, parallel=True), text)
    assert [(a["name"], json.loads(a["arguments"])) for _, a in sorted(assembled.items())] == EXPECTED
    assert streamed_content.strip() == (content or "")
    single = ToolCalls(tool_parser(family), TOOLS, parallel=False).message(text)[1]
    assert [c.function.name for c in single] == ["get_weather"]


@pytest.mark.parametrize("family", OUTPUTS)
def test_plain_text_is_content(family: str) -> None:
    text = "The weather in Paris is sunny <b>today</b>."
    assert ToolCalls(tool_parser(family), TOOLS, parallel=True).message(text) == (text, [])
    content, assembled = _streamed(ToolCalls(tool_parser(family), TOOLS, parallel=True), text)
    assert content == text and not assembled


def test_parser_detected_from_template() -> None:
    assert detect_tool_parser("{{ '<tool_call>' + name }}<arg_key>{{ k }}</arg_key>") == "glm45"
    assert detect_tool_parser("{{- '<|python_tag|>' }}") == "llama3_json"
    assert detect_tool_parser("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert detect_tool_parser(None) == "hermes"


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    from glmserve.models.gguf_loader import embedded_default_gguf, load_gguf

    tokenizer = load_gguf(embedded_default_gguf()).tokenizer()
    return GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


@pytest.mark.parametrize("family", OUTPUTS)
def test_forcing_grammar_accepts_the_family_format(family: str, compiler: GrammarCompiler) -> None:
    parser = tool_parser(family)
    grammar = compiler.compile(GuidedSpec("grammar", parser.grammar(TOOLS, parallel=True)))
    text = OUTPUTS[family]
    text = text[text.index("<") if family != "llama3_json" else text.index("{"):]  # the calls, without content
    matcher = grammar.matcher()
    for token in compiler._hf_tokenizer.encode(text, add_special_tokens=False):
        assert matcher.consume_token(token), (family, matcher.get_error())
    assert matcher.is_accepting()
    one = compiler.compile(GuidedSpec("grammar", parser.grammar(TOOLS[:1], parallel=False))).matcher()
    assert one.validate_tokens(compiler._hf_tokenizer.encode(text, add_special_tokens=False)) < len(
        compiler._hf_tokenizer.encode(text, add_special_tokens=False))  # a second call, or another tool, is refused
