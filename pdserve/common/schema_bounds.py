"""Caps on a client's JSON schema, checked before anything compiles it.

A `response_format` schema, or a forced tool's `parameters`, becomes an llguidance
grammar on the node; its size and nesting are capped first, by the router and the node
alike (the router without asking a node), so an oversized or deeply nested one costs its
own request a 400 naming the field. What compiles within the caps is bounded in time by
the node's compile workers (`pdserve.engine.grammar_check`).
"""

from __future__ import annotations

import json

from pdserve.common.errors import InvalidRequestError

MAX_SCHEMA_BYTES = 64 << 10  # one schema, as JSON
MAX_SCHEMA_DEPTH = 48  # nested objects and arrays


def check_schema_bounds(schema: object, param: str) -> None:
    """InvalidRequestError naming `param` when `schema` is over either cap."""
    size = len(json.dumps(schema))
    if size > MAX_SCHEMA_BYTES:
        raise InvalidRequestError(
            f"the schema is {size} bytes; at most {MAX_SCHEMA_BYTES} are accepted", param
        )
    todo, deepest = [(schema, 1)], 0
    while todo:
        node, depth = todo.pop()
        deepest = max(deepest, depth)
        if deepest > MAX_SCHEMA_DEPTH:
            raise InvalidRequestError(
                f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels", param
            )
        children = (
            node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        )
        todo += [(c, depth + 1) for c in children if isinstance(c, (dict, list))]


def check_request_schemas(req) -> None:
    """The caps on every schema an OpenAI request (`api.protocol`) would have compiled:
    its `response_format` schema, and each forced tool's parameters."""
    rf = getattr(req, "response_format", None)
    if rf is not None and rf.type == "json_schema" and rf.json_schema is not None:
        if rf.json_schema.schema_ is not None:
            check_schema_bounds(rf.json_schema.schema_, "response_format.json_schema")
    if getattr(req, "tool_choice", None) in (None, "none", "auto"):
        return
    for tool in getattr(req, "tools", None) or ():
        if tool.function.parameters is not None:
            check_schema_bounds(tool.function.parameters, "tools")
