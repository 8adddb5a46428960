"""`response_format` and `tools` -> an llguidance grammar for the engine, and generated
text -> OpenAI `tool_calls`.

- `response_format`: `json_object` constrains to any JSON object, `json_schema` to its
  schema (compact separators, no free whitespace, so a small model cannot wander).
- `tools` with `tool_choice` `required` or a named function: the output is constrained to
  `{"name": <one of the tools>, "arguments": <its parameters schema>}` and returned as a
  `tool_calls` entry (finish_reason `tool_calls`, content null).
- `tool_choice` `auto` (the default with tools): unconstrained; a reply that holds
  `<tool_call>{"name": ..., "arguments": ...}</tool_call>` (the Hermes convention most
  open chat models use) is returned as tool calls. `none`: tools are not shown.
- Tools reach the model through the chat template (`tools=`); a template that does not
  render tools gets them described in a system message instead.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve.api import chat_tools
from pdserve.api.protocol import ChatCompletionRequest
from pdserve.api.structured import FunctionCall, ToolCall
from pdserve.common.errors import InvalidRequestError
from pdserve.common.schema_bounds import check_schema_bounds
from pdserve.engine.grammar import parser_limits

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass
class Plan:
    grammar: str | None = None
    tools_forced: bool = False  # the whole output is one tool call
    tools_auto: bool = False  # parse <tool_call> blocks out of the reply
    tool_names: frozenset[str] = frozenset()


def validate_in_process(grammar: str) -> str | None:
    """llguidance's validation here, on this thread (trusted grammars; a node checks a
    client's in a worker process: `pdserve.engine.grammar_check`)."""
    import llguidance

    return llguidance.LLMatcher.validate_grammar(grammar, limits=parser_limits()) or None


def json_grammar(
    schema: dict[str, Any], param: str, check: Callable[[str], str | None] = validate_in_process
) -> str:
    """The grammar of `schema`, once `check` finds no error in it (a 400 naming `param`)."""
    import llguidance

    check_schema_bounds(schema, param)
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError as e:
        raise InvalidRequestError(f"invalid JSON schema: {e}", param) from e
    error = check(grammar)
    if error:
        raise InvalidRequestError(f"unsupported JSON schema: {error}", param)
    return grammar


def plan(req, check: Callable[[str], str | None] = validate_in_process) -> Plan:
    """What `req` asks for (chat or completions request); `check` validates a grammar."""
    rf = req.response_format
    tools = getattr(req, "tools", None) or []
    choice = getattr(req, "tool_choice", None)
    names = frozenset(t.function.name for t in tools)
    if choice not in (None, "none", "auto") and not tools:
        raise InvalidRequestError("tool_choice needs tools", "tool_choice")
    forced = tools and choice not in (None, "none", "auto")
    if rf is not None and rf.type != "text" and forced:
        raise InvalidRequestError(
            "response_format and a forced tool_choice cannot be combined", "response_format"
        )
    if rf is not None and rf.type == "json_object":
        return Plan(grammar=json_grammar({"type": "object"}, "response_format", check))
    if rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise InvalidRequestError("json_schema needs a schema", "response_format.json_schema")
        return Plan(
            grammar=json_grammar(rf.json_schema.schema_, "response_format.json_schema", check)
        )
    if forced:
        if choice == "required":
            chosen = tools
        else:
            chosen = [t for t in tools if t.function.name == choice.function.name]
            if not chosen:
                raise InvalidRequestError(
                    f"tool_choice names {choice.function.name!r}, which is not in tools",
                    "tool_choice",
                )
        schema = {"anyOf": [_call_schema(t.function) for t in chosen]}
        return Plan(
            grammar=json_grammar(schema, "tools", check), tools_forced=True, tool_names=names
        )
    return Plan(tools_auto=bool(tools) and choice != "none", tool_names=names)


def _call_schema(fn) -> dict[str, Any]:
    params = fn.parameters or {"type": "object", "properties": {}}
    return {
        "type": "object",
        "properties": {"name": {"const": fn.name}, "arguments": params},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def template_tools(req: ChatCompletionRequest, tokenizer) -> tuple[list[dict], dict]:
    """(messages, extra template kwargs) for this node's tokenizer (`pdserve.api.chat_tools`)."""
    return chat_tools.template_tools(req, getattr(tokenizer, "chat_template", None))


def tool_calls(p: Plan, text: str) -> list[ToolCall] | None:
    """The tool calls in a reply (None when it holds none)."""
    if p.tools_forced:
        blobs = [text]
    elif p.tools_auto:
        blobs = chat_tools.TOOL_CALL.findall(text)
    else:
        return None
    calls = []
    for blob in blobs:
        try:
            obj = json.loads(blob)
        except json.JSONDecodeError:
            continue
        if not isinstance(obj, dict) or obj.get("name") not in p.tool_names:
            continue
        args = obj.get("arguments", {})
        calls.append(
            ToolCall(
                id=f"call_{uuid.uuid4().hex[:24]}",
                function=FunctionCall(name=obj["name"], arguments=json.dumps(args)),
            )
        )
    return calls or None
