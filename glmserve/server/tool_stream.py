"""Tool calls of one choice as OpenAI sends them: whole (`message.tool_calls`) or streamed deltas.

A streamed call starts with a delta holding its index, id, type and name (arguments ""), then argument
fragments; the fragments joined are the call's arguments. Content before the first call streams as content.
"""

from __future__ import annotations

import uuid

from glmserve.server.protocol import FunctionCall, FunctionCallDelta, ToolCall, ToolCallDelta, ToolDefinition
from glmserve.server.tool_parsers import PartialCall, ToolParser


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCalls:
    """Reads one choice's cumulative text with a tool parser (`parallel` False: only the first call counts)."""

    def __init__(self, parser: ToolParser, tools: list[ToolDefinition], parallel: bool) -> None:
        self._parser = parser
        self._tools = tools
        self._parallel = parallel
        self._sent_content = 0
        self._ids: list[str] = []
        self._sent_args: list[str] = []

    def _calls(self, text: str, final: bool) -> tuple[str, list[PartialCall]]:
        parsed = self._parser.parse(text, final, self._tools)
        calls = [c for c in parsed.calls if c.name is not None or not c.complete]
        return parsed.content, calls if self._parallel else calls[:1]

    def message(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The finished answer's content (None when only calls) and its tool calls."""
        content, calls = self._calls(text, final=True)
        tool_calls = [ToolCall(id=call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
                      for c in calls if c.name is not None]
        if not tool_calls:
            return text, []
        return content.strip() or None, tool_calls

    def deltas(self, text: str, final: bool) -> tuple[str, list[ToolCallDelta]]:
        """What `text` (the whole output so far) adds to what was sent: content and tool-call deltas."""
        content, calls = self._calls(text, final)
        content_delta = content[self._sent_content:]
        self._sent_content = max(self._sent_content, len(content))
        out: list[ToolCallDelta] = []
        for i, call in enumerate(calls):
            if call.name is None:
                break
            if i == len(self._ids):
                self._ids.append(call_id())
                self._sent_args.append("")
                out.append(ToolCallDelta(index=i, id=self._ids[i], type="function",
                                         function=FunctionCallDelta(name=call.name, arguments="")))
            sent = self._sent_args[i]
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                out.append(ToolCallDelta(index=i, function=FunctionCallDelta(arguments=call.arguments[len(sent):])))
                self._sent_args[i] = call.arguments
        return content_delta, out

    @property
    def called(self) -> bool:
        """Whether a streamed call was sent."""
        return bool(self._ids)
