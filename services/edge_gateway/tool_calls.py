"""Tool calls in the chat API: how the tools reach the prompt, the grammar an answer
follows, and how a call is read back out of the generated text.

The format (the embedded model's chat template has none): a system turn placed first lists
the tools as JSON and asks for a call as one line

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

and an earlier call in the conversation is rendered the same way in its assistant turn.
``tool_choice`` picks the grammar: "required" and a named function constrain the whole
answer to one such call, its arguments under the function's JSON schema; "auto" allows
either one call or text that does not begin with "<" (so a call is never half-written);
"none" leaves the answer free and the tools out of the prompt. One call per answer.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from asymspec.grammar import COMPACT_JSON
from edge_gateway.schemas import FunctionCall, NamedToolChoice, Tool, ToolCall

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


def _call_schema(tool: Tool) -> dict[str, Any]:
    parameters = tool.function.parameters or {"type": "object", "properties": {}}
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def chosen_tools(tools: list[Tool], choice: str | NamedToolChoice) -> list[Tool]:
    """The tools an answer may call under ``choice`` (a named one must exist)."""
    if isinstance(choice, NamedToolChoice):
        named = [t for t in tools if t.function.name == choice.function.name]
        if not named:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not in tools")
        return named
    return [] if choice == "none" else tools


def lark_grammar(tools: list[Tool], choice: str | NamedToolChoice) -> str | None:
    """The Lark grammar (llguidance's dialect, ``%json`` for a schema) of an answer."""
    callable_tools = chosen_tools(tools, choice)
    if not callable_tools:
        return None
    schemas = [_call_schema(t) for t in callable_tools]
    schema: dict[str, Any] = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    schema = {**schema, "x-guidance": COMPACT_JSON}  # as response_format's: no runs of blanks
    rules = [
        f"call: {json.dumps(CALL_OPEN)} args {json.dumps(CALL_CLOSE)}",
        f"args: %json {json.dumps(schema)}",
    ]
    if choice == "auto":
        rules = ["start: call | TEXT", *rules, r"TEXT: /[^<][\s\S]*/"]
    else:
        rules = ["start: call", *rules]
    return "\n".join(rules) + "\n"


def tools_prompt(tools: list[Tool], choice: str | NamedToolChoice) -> str:
    """The system turn that tells the model its tools and the call format."""
    listed = [t.function.model_dump(exclude_none=True) for t in chosen_tools(tools, choice)]
    return (
        "You can call these tools (JSON):\n"
        + json.dumps(listed)
        + f"\nTo call one, answer with exactly {CALL_OPEN}"
        + '{"name": <tool name>, "arguments": <arguments object>}'
        + f"{CALL_CLOSE} and nothing else."
    )


def render_calls(calls: list[ToolCall]) -> str:
    """An assistant turn's earlier calls, in the format the model writes them."""
    parts = []
    for call in calls:
        try:
            arguments = json.loads(call.function.arguments)
        except json.JSONDecodeError:
            raise ValueError(f"tool call {call.id}: arguments are not JSON") from None
        body = json.dumps({"name": call.function.name, "arguments": arguments})
        parts.append(f"{CALL_OPEN}{body}{CALL_CLOSE}")
    return "\n".join(parts)


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it

    def as_tool_call(self) -> ToolCall:
        return ToolCall(
            id=f"call_{uuid.uuid4().hex[:24]}",
            function=FunctionCall(name=self.name, arguments=self.arguments),
        )


def parse_call(text: str) -> ParsedCall | None:
    """The call an answer holds, or None for a text answer (or an unfinished call: the
    token budget ran out inside it)."""
    if not (text.startswith(CALL_OPEN) and text.endswith(CALL_CLOSE)):
        return None
    try:
        body = json.loads(text[len(CALL_OPEN) : -len(CALL_CLOSE)])
    except json.JSONDecodeError:
        return None
    if not isinstance(body, dict) or not isinstance(body.get("name"), str):
        return None
    return ParsedCall(body["name"], json.dumps(body.get("arguments", {})))
