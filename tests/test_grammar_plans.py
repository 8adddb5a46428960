"""The node's structured-output plans: built on a worker thread, cached by what the
request asks, 400 (naming the field) on an invalid schema (one past the deadline, in a
worker process: tests/test_hostile_input.py)."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.api.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.common.errors import InvalidRequestError
from pdserve.node.grammar_plans import GrammarPlans

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def completion(schema) -> CompletionRequest:
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    return CompletionRequest(prompt="hi", response_format=rf)


def test_a_schema_compiles_once_and_is_cached():
    plans = GrammarPlans()
    first = asyncio.run(plans.plan(completion(SCHEMA)))
    again = asyncio.run(plans.plan(completion(dict(reversed(SCHEMA.items())))))  # same schema
    assert first.grammar and again is first and (plans.misses, plans.hits) == (1, 1)
    other = asyncio.run(plans.plan(completion({**SCHEMA, "required": []})))
    assert other.grammar != first.grammar and plans.misses == 2
    plain = asyncio.run(plans.plan(CompletionRequest(prompt="hi")))  # nothing to compile
    assert plain.grammar is None and plans.misses == 2


def test_tools_are_cached_by_tools_and_choice():
    tool = {"type": "function", "function": {"name": "f", "parameters": SCHEMA}}
    plans = GrammarPlans()
    msgs = [{"role": "user", "content": "x"}]
    forced = ChatCompletionRequest(messages=msgs, tools=[tool], tool_choice="required")
    auto = ChatCompletionRequest(messages=msgs, tools=[tool], tool_choice="auto")
    a, b = asyncio.run(plans.plan(forced)), asyncio.run(plans.plan(auto))
    assert a.tools_forced and a.grammar and not b.tools_forced and b.grammar is None


def test_invalid_schema_is_a_400_naming_the_field():
    with pytest.raises(InvalidRequestError) as e:
        asyncio.run(GrammarPlans().plan(completion({"type": "integer", "minimum": "x"})))
    assert e.value.param.startswith("response_format")
