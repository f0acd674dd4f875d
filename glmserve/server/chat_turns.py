"""API messages as the chat template's turns, tools included.

Assistant `tool_calls` get their arguments as objects (templates write `arguments | tojson`, as vLLM passes
them), `tool` turns keep their `tool_call_id`. A template that has no tool support gets the tools described in
a system turn, in the hermes format the server then parses (the wording of Qwen 2.5's template).
"""

from __future__ import annotations

import json
from typing import Any

from glmserve.server.protocol import ChatMessage, ToolDefinition


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def chat_turns(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    turns = []
    for m in messages:
        turn: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.tool_calls:
            turn["tool_calls"] = [{"id": c.id, "type": "function",
                                   "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                                  for c in m.tool_calls]
        if m.tool_call_id is not None:
            turn["tool_call_id"] = m.tool_call_id
        if m.name is not None and m.role == "tool":
            turn["name"] = m.name
        turns.append(turn)
    return turns


def template_supports_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def tools_system_turn(tools: list[ToolDefinition]) -> dict[str, Any]:
    """A system turn that describes `tools` and the hermes call format."""
    specs = "\n".join(json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False) for t in tools)
    return {"role": "system", "content": (
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{specs}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')}


def _calls_as_text(turn: dict[str, Any]) -> dict[str, Any]:
    """An assistant turn's tool calls written into its content, in the hermes format."""
    calls = "\n".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                     "arguments": c["function"]["arguments"]}, ensure_ascii=False)
                      + "\n</tool_call>" for c in turn.get("tool_calls", ()))
    content = "\n".join(part for part in (turn["content"], calls) if part)
    return {k: v for k, v in {**turn, "content": content}.items() if k != "tool_calls"}


def template_turns(messages: list[ChatMessage], tools: list[ToolDefinition], chat_template: str | None
                   ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The turns and the `tools=` argument for apply_chat_template: the tools go to the template when it renders
    them, else into a system turn (merged into the first system turn if there is one), and earlier calls into
    their assistant turns' text."""
    turns = chat_turns(messages)
    if template_supports_tools(chat_template):
        return turns, [t.model_dump(exclude_none=True) for t in tools] or None
    turns = [_calls_as_text(t) if "tool_calls" in t else t for t in turns]
    if not tools:
        return turns, None
    system = tools_system_turn(tools)
    if turns and turns[0]["role"] == "system":
        merged = {**turns[0], "content": f"{turns[0]['content']}\n\n{system['content']}"}
        return [merged, *turns[1:]], None
    return [system, *turns], None
