"""Structured-output plans built off the event loop, cached by what the request asks.

Turning a JSON schema into an llguidance grammar takes milliseconds; compiling it can
take seconds for a hostile one. A request with `response_format` or `tools` has its plan
built on a worker thread, which converts the schema (its size and depth capped first)
and has the grammar compiled in a worker process (`pdserve.engine.grammar_check`, killed
at `grammar_deadline_s`), so the thread itself returns by the deadline. Plans are cached
(LRU) by `response_format`, `tools` and `tool_choice`, so a schema sent again costs a
dictionary lookup. An invalid schema, or one that does not compile within the deadline,
is a 400 naming the field; no worker free in time is a 429.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict

from pdserve.common.errors import InvalidRequestError
from pdserve.engine.grammar_check import GrammarCheckPool, GrammarTimeout
from pdserve.node import structured_output as structured


class GrammarPlans:
    """`pool`: where client grammars compile (set once the engine is up; without one, in
    process, as for trusted input)."""

    def __init__(self, max_entries: int = 256, pool: GrammarCheckPool | None = None):
        self.max_entries = max_entries
        self.pool = pool
        self._cache: OrderedDict[str, structured.Plan] = OrderedDict()
        self.hits = 0
        self.misses = 0

    async def plan(self, req) -> structured.Plan:
        rf = req.response_format
        tools = getattr(req, "tools", None)
        if (rf is None or rf.type == "text") and not tools:
            return structured.plan(req)  # nothing to compile
        key = _key(req)
        hit = self._cache.get(key)
        if hit is not None:
            self.hits += 1
            self._cache.move_to_end(key)
            return hit
        self.misses += 1
        pool = self.pool
        check = pool.check if pool is not None else structured.validate_in_process
        try:
            plan = await asyncio.to_thread(structured.plan, req, check)
        except GrammarTimeout:
            param = "response_format" if rf is not None and rf.type != "text" else "tools"
            raise InvalidRequestError(
                f"the schema did not compile within {pool.deadline_s:g} s", param
            ) from None
        self._cache[key] = plan
        while len(self._cache) > self.max_entries:
            self._cache.popitem(last=False)
        return plan


def _key(req) -> str:
    def dump(x):
        if x is None or isinstance(x, str):
            return x
        if isinstance(x, list):
            return [dump(v) for v in x]
        return x.model_dump(mode="json", by_alias=True, exclude_none=True)

    return json.dumps(
        [
            dump(req.response_format),
            dump(getattr(req, "tools", None)),
            dump(getattr(req, "tool_choice", None)),
        ],
        sort_keys=True,
    )
