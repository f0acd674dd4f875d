"""Reasoning parsers (glmserve/server/reasoning.py) and the Responses API's output items
(glmserve/server/serving_responses.py): a stream read token by token ends where the whole answer does."""

from __future__ import annotations

import pytest
from tiny_models import tiny_tokenizer

from glmserve.engine.detokenizer import IncrementalDetokenizer
from glmserve.engine.outputs import CompletionOutput, TokenLogprob
from glmserve.engine.sampling import SamplingParams
from glmserve.engine.sequence import Sequence
from glmserve.server.logprobs import TokenFormatter
from glmserve.server.protocol import ToolDefinition
from glmserve.server.reasoning import ReasoningStream, reasoning_parser, reasoning_tokens, thinking_disabled
from glmserve.server.serving_responses import OutputBuilder
from glmserve.server.tool_parsers import tool_parser
from glmserve.server.tool_stream import ToolCalls

CASES = {
    # text -> (glm45, deepseek_r1) as (reasoning, content)
    "<think>plan it</think>\n\nThe answer.": (("plan it", "The answer."), ("plan it", "The answer.")),
    "plan it</think>The answer.": ((None, "plan it</think>The answer."), ("plan it", "The answer.")),
    "Just an answer.": ((None, "Just an answer."), ("Just an answer.", "")),
    "<think>cut short": (("cut short", ""), ("cut short", "")),
    "<think></think>Hello": (("", "Hello"), ("", "Hello")),
}


def _streamed(name: str, text: str, step: int = 1) -> tuple[str, list[str]]:
    """The reasoning deltas joined and the content after each step of a stream of `text`."""
    stream = ReasoningStream(reasoning_parser(name))
    deltas, contents = [], []
    for end in [*range(step, len(text), step), len(text)]:
        deltas.append(stream.update(text[:end], final=end == len(text)))
        contents.append(stream.content)
    return "".join(deltas), contents


@pytest.mark.parametrize("text", list(CASES))
@pytest.mark.parametrize("index,name", [(0, "glm45"), (1, "deepseek_r1")])
def test_split_whole_and_streamed(text: str, index: int, name: str) -> None:
    expected = CASES[text][index]
    assert reasoning_parser(name).split(text, final=True) == expected
    for step in (1, 3):
        reasoning, contents = _streamed(name, text, step)
        assert reasoning == (expected[0] or "")
        assert contents[-1] == expected[1]
        assert all(b.startswith(a) for a, b in zip(contents, contents[1:]))  # content only grows
        assert not any("<" in c and "think" in c for c in contents[:-1] if expected[0] is not None)


def test_thinking_switch_and_unknown_parser() -> None:
    assert thinking_disabled({"enable_thinking": False}) and thinking_disabled({"thinking": False})
    assert not thinking_disabled(None) and not thinking_disabled({"enable_thinking": True})
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        reasoning_parser("qwen9")


def test_reasoning_tokens_are_those_between_the_tags() -> None:
    glm, r1 = reasoning_parser("glm45"), reasoning_parser("deepseek_r1")
    text = "<think>pl</think>A"
    assert reasoning_tokens(glm, text, [7, 8, 9, 17, 18]) == 2  # a token per tag, as GLM's: <think> p l </think> A
    # tags of several tokens: "<" "think" ">p" "l" "</" "think>" "A"; the token with the tag's end and "p" counts
    assert reasoning_tokens(glm, text, [1, 6, 8, 9, 11, 17, 18]) == 2
    assert reasoning_tokens(glm, "<think>abc", [7, 8, 9, 10]) == 3  # cut short while thinking: all after the tag
    assert reasoning_tokens(r1, "ab</think>c", [1, 2, 10, 11]) == 2  # the template opened the tag
    assert reasoning_tokens(glm, "<think></think>Hi", [7, 15, 17]) == 0
    assert reasoning_tokens(glm, "Hello", [5]) == 0 and reasoning_tokens(None, text, [7, 8, 9, 17, 18]) == 0


WEATHER = ToolDefinition.model_validate({"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}})
ANSWER = ('<think>The user wants weather.</think>\nLet me check.\n<tool_call>\n'
          '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')


def _builder() -> OutputBuilder:
    return OutputBuilder(reasoning_parser("glm45"), ToolCalls(tool_parser("hermes"), [WEATHER], parallel=True))


def test_output_items_whole_and_streamed() -> None:
    whole = _builder()
    whole.feed(ANSWER, final=True)
    whole.close(complete=True)
    kinds = [(i.type, i.status) for i in whole.items]
    assert kinds == [("reasoning", "completed"), ("message", "completed"), ("function_call", "completed")]
    reasoning, message, call = whole.items
    assert reasoning.content[0].text == "The user wants weather."
    assert message.content[0].text.strip() == "Let me check."
    assert call.name == "get_weather" and call.arguments == '{"city": "Paris"}'

    streamed, events = _builder(), []
    for end in range(1, len(ANSWER) + 1):
        events += streamed.feed(ANSWER[:end], final=end == len(ANSWER))
    events += streamed.close(complete=True)
    assert [i.model_dump(exclude={"id", "call_id"}) for i in streamed.items] == [
        i.model_dump(exclude={"id", "call_id"}) for i in whole.items]
    # each item: added, its deltas, done; items in order, never interleaved
    opened = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    closed = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert opened == closed == [0, 1, 2]
    deltas = {t: "".join(e["delta"] for e in events if e["type"] == t) for t in (
        "response.reasoning_text.delta", "response.output_text.delta", "response.function_call_arguments.delta")}
    assert deltas == {"response.reasoning_text.delta": reasoning.content[0].text,
                      "response.output_text.delta": streamed.items[1].content[0].text,
                      "response.function_call_arguments.delta": call.arguments}
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert done["arguments"] == call.arguments and done["name"] == "get_weather"


def test_blank_text_before_a_call_makes_no_message_and_an_empty_answer_one() -> None:
    builder = OutputBuilder(None, ToolCalls(tool_parser("hermes"), [WEATHER], parallel=True))
    builder.feed('\n<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>', final=True)
    builder.close(complete=True)
    assert [i.type for i in builder.items] == ["function_call"]
    empty = OutputBuilder(None, None)
    events = empty.feed("", final=True) + empty.close(complete=False)
    assert [(i.type, i.status, i.content[0].text) for i in empty.items] == [("message", "incomplete", "")]
    assert [e["type"] for e in events] == ["response.output_item.added", "response.content_part.added",
                                           "response.output_text.done", "response.content_part.done",
                                           "response.output_item.done"]


def _engine_output(tokenizer, text: str) -> CompletionOutput:
    """What the engine hands back for an output of `text`'s tokens (made-up logprobs): the text ends are the
    sequence's own (Sequence.detokenize)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    seq = Sequence("r", 0, [0], SamplingParams(logprobs=1), IncrementalDetokenizer(tokenizer, [0], stop=[]))
    for i, token in enumerate(ids):
        seq.append_token(token, TokenLogprob(token, -i / 8, [(token, -i / 8)]))
        seq.detokenize(token)
    return CompletionOutput(0, seq.detokenizer.text, seq.output_token_ids, seq.logprobs, text_ends=seq.text_ends)


def test_message_logprobs_are_its_tokens_whole_and_streamed() -> None:
    tokenizer = tiny_tokenizer(320)
    out = _engine_output(tokenizer, ANSWER)
    assert out.text == ANSWER and out.text_ends[-1] == len(ANSWER)
    pieces = [tokenizer.decode([t]) for t in out.token_ids]  # ASCII: the pieces are the text, token by token
    starts = [sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]
    thought = (len("<think>"), ANSWER.index("</think>"))
    assert reasoning_tokens(reasoning_parser("glm45"), out.text, out.text_ends) == sum(
        s < thought[1] and s + len(p) > thought[0] for s, p in zip(starts, pieces)) > 3

    def builder() -> OutputBuilder:
        return OutputBuilder(reasoning_parser("glm45"), ToolCalls(tool_parser("hermes"), [WEATHER], parallel=True),
                             TokenFormatter(tokenizer))

    whole = builder()
    whole.feed(out.text, final=True, tokens=out)
    whole.close(complete=True)
    message = whole.items[1].content[0]
    assert message.text.strip() == "Let me check." and message.logprobs
    assert "".join(lp["token"] for lp in message.logprobs).strip() == "Let me check."
    assert all(len(lp["top_logprobs"]) == 1 for lp in message.logprobs)

    streamed, events = builder(), []
    for k in range(len(out.token_ids)):
        prefix = CompletionOutput(0, out.text[:out.text_ends[k]], out.token_ids[:k + 1], out.logprobs[:k + 1],
                                  text_ends=out.text_ends[:k + 1])
        events += streamed.feed(prefix.text, final=k == len(out.token_ids) - 1, tokens=prefix)
    events += streamed.close(complete=True)
    deltas = [lp for e in events if e["type"] == "response.output_text.delta" for lp in e["logprobs"]]
    done = next(e for e in events if e["type"] == "response.output_text.done")
    assert deltas == done["logprobs"] == message.logprobs == streamed.items[1].content[0].logprobs
