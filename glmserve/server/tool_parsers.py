"""Tool-call formats of the model families we serve: parse the output, and the grammar that forces a call.

Each parser reads the cumulative output text into the content before the calls and the calls seen so far, each
with its name once known and the part of its arguments (JSON text) that can no longer change; the same reading
serves a finished answer and a stream (glmserve/server/tool_stream.py). Formats, as the models' chat templates
write them (and vLLM's parsers read them, vllm/entrypoints/openai/tool_parsers/):
- hermes (Qwen 2.5/3, Hermes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one per call;
- llama3_json (Llama 3.1+): `{"name": ..., "parameters": {...}}`, calls separated by `;`, optionally after
  `<|python_tag|>`;
- glm45 (GLM-4.5/4.6/5.x): `<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n...</tool_call>`,
  values as text (strings) or JSON (other types).
The grammars are llguidance lark (glmserve/engine/structured.py), JSON parts as `%json` schemas.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: the command line imports TOOL_CALL_PARSERS (server/config.py)
    from glmserve.server.protocol import ToolDefinition

JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "glm45")


@dataclass
class PartialCall:
    name: str | None  # None until the model has written it
    arguments: str  # JSON text of the arguments so far: a prefix of the final arguments
    complete: bool


@dataclass
class ParsedOutput:
    content: str  # text before the first call (all of it when there is no call)
    calls: list[PartialCall]


def _held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that could be the start of `marker` (not shown yet)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _stable_prefix(rest: str) -> str:
    """Of an unfinished `"arguments": VALUE}` tail, the part of VALUE that stays: all but the last non-blank
    character (it may be the enclosing object's `}`) and the blanks before it."""
    return rest.rstrip()[:-1].rstrip()


def _name_first(keys: str) -> re.Pattern[str]:
    return re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:' + keys + r')"\s*:\s*')


class _JsonCalls:
    """Calls written as a JSON object {"name": ..., KEY: {...}}."""

    arg_keys = "arguments"

    def __init__(self) -> None:
        self._pattern = _name_first(self.arg_keys)

    def json_call(self, body: str, complete: bool) -> PartialCall | None:
        """The call in `body` (None: a complete body that is not a call object)."""
        match = self._pattern.match(body)
        if not complete:
            if match is None:
                return PartialCall(None, "", False)
            return PartialCall(json.loads(f'"{match.group(1)}"'), _stable_prefix(body[match.end():]), False)
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        keys = [k for k in self.arg_keys.split("|") if k in obj]
        args = obj[keys[0]] if keys else {}
        raw = _stable_prefix(body[match.end():]) if match else ""
        try:
            if raw and json.loads(raw) == args:
                return PartialCall(obj["name"], raw, True)  # the model's own text, as it was streamed
        except ValueError:
            pass
        return PartialCall(obj["name"], json.dumps(args, ensure_ascii=False), True)

    def call_schema(self, tools: list[ToolDefinition]) -> dict[str, Any]:
        key = self.arg_keys.split("|")[0]
        options = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                      key: t.function.parameters or {"type": "object"}},
                    "required": ["name", key], "additionalProperties": False} for t in tools]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        return {**schema, "x-guidance": JSON_STYLE}


class _TaggedCalls:
    """Calls in `<tool_call>...</tool_call>` blocks after the content."""

    open_tag = "<tool_call>"
    close_tag = "</tool_call>"

    def body_call(self, body: str, complete: bool, tools: list[ToolDefinition]) -> PartialCall | None:
        raise NotImplementedError

    def parse(self, text: str, final: bool, tools: list[ToolDefinition]) -> ParsedOutput:
        start = text.find(self.open_tag)
        if start < 0:
            return ParsedOutput(text if final else text[:len(text) - _held_back(text, self.open_tag)], [])
        calls = []
        for block in text[start + len(self.open_tag):].split(self.open_tag):
            end = block.find(self.close_tag)
            complete = end >= 0 or final
            body = block[:end] if end >= 0 else block[:len(block) - _held_back(block, self.close_tag)]
            call = self.body_call(body.strip() if complete else body, complete, tools)
            if call is not None:
                calls.append(call)
        return ParsedOutput(text[:start], calls)


class HermesParser(_TaggedCalls, _JsonCalls):
    name = "hermes"

    def body_call(self, body: str, complete: bool, tools: list[ToolDefinition]) -> PartialCall | None:
        return self.json_call(body, complete)

    def grammar(self, tools: list[ToolDefinition], parallel: bool) -> str:
        calls = 'call ("\\n" call)*' if parallel else "call"
        return (f"start: {calls}\n"
                f'call: "{self.open_tag}\\n" call_json "\\n{self.close_tag}"\n'
                f"call_json: %json {json.dumps(self.call_schema(tools))}\n")


class Llama3JsonParser(_JsonCalls):
    name = "llama3_json"
    arg_keys = "parameters|arguments"
    python_tag = "<|python_tag|>"

    def parse(self, text: str, final: bool, tools: list[ToolDefinition]) -> ParsedOutput:
        body = text.lstrip()
        tagged = body.startswith(self.python_tag)
        if tagged:
            body = body[len(self.python_tag):].lstrip()
        if not final and (self.python_tag.startswith(body) or (tagged and not body)):
            return ParsedOutput("", [])  # maybe the tag, maybe text
        if not body.startswith("{"):
            return ParsedOutput(text, [])
        calls: list[PartialCall] = []
        decoder = json.JSONDecoder()
        pos = 0
        while pos < len(body):
            try:
                _, end = decoder.raw_decode(body, pos)
            except ValueError:
                call = self.json_call(body[pos:], final)
                if call is not None:
                    calls.append(call)
                break
            call = self.json_call(body[pos:end], True)
            if call is None:
                return ParsedOutput(text, []) if final else ParsedOutput("", calls)
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in "; \n\t":
                pos += 1
        return ParsedOutput("", calls)

    def grammar(self, tools: list[ToolDefinition], parallel: bool) -> str:
        calls = 'call_json ("; " call_json)*' if parallel else "call_json"
        return f"start: {calls}\ncall_json: %json {json.dumps(self.call_schema(tools))}\n"


_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


class Glm45Parser(_TaggedCalls):
    name = "glm45"

    def body_call(self, body: str, complete: bool, tools: list[ToolDefinition]) -> PartialCall | None:
        head = re.match(r"\s*([^\n<]+?)\s*(?:\n|<arg_key>)", body) or (re.match(r"\s*(\S+)\s*$", body)
                                                                      if complete else None)
        if head is None:
            return None if complete else PartialCall(None, "", False)
        name = head.group(1)
        types = {}
        for tool in tools:
            if tool.function.name == name:
                types = {k: v.get("type") for k, v in ((tool.function.parameters or {}).get("properties") or {}).items()
                         if isinstance(v, dict)}
        pairs = [f"{json.dumps(k.strip())}: {json.dumps(self._value(v, types.get(k.strip())), ensure_ascii=False)}"
                 for k, v in _PAIR.findall(body)]
        return PartialCall(name, "{" + ", ".join(pairs) + ("}" if complete else ""), complete)

    @staticmethod
    def _value(text: str, kind: Any) -> Any:
        """A string parameter as written; anything else as JSON when it parses (GLM's template writes tojson)."""
        text = text.strip()
        if kind == "string":
            return text
        try:
            return json.loads(text)
        except ValueError:
            return text

    def grammar(self, tools: list[ToolDefinition], parallel: bool) -> str:
        rules = []
        for i, tool in enumerate(tools):
            keys = list((tool.function.parameters or {}).get("properties") or {})
            key_rule = " | ".join(json.dumps(k) for k in keys) or '""'
            rules.append(f'call{i}: "{self.open_tag}{tool.function.name}\\n" (arg{i} "\\n")* "{self.close_tag}"\n'
                         f'arg{i}: "<arg_key>" ({key_rule}) "</arg_key>\\n<arg_value>" VALUE "</arg_value>"')
        calls = 'call ("\\n"? call)*' if parallel else "call"
        return (f"start: {calls}\ncall: " + " | ".join(f"call{i}" for i in range(len(tools))) + "\n"
                + "\n".join(rules) + "\nVALUE: /[^<]*/\n")


ToolParser = HermesParser | Llama3JsonParser | Glm45Parser


def tool_parser(name: str) -> ToolParser:
    parsers = {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "glm45": Glm45Parser}
    if name not in parsers:
        raise ValueError(f"unknown tool-call parser {name!r}; expected one of {TOOL_CALL_PARSERS}")
    return parsers[name]()


def detect_tool_parser(chat_template: str | None) -> str:
    """The parser a chat template implies: GLM's `<arg_key>`, Llama's `<|python_tag|>`, else hermes (also the
    format glmserve describes tools in for a template that has no tool support)."""
    template = chat_template or ""
    if "<arg_key>" in template:
        return "glm45"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"
