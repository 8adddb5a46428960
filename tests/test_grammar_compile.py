"""Grammars compile off the engine loop (real SmolLM2, real llguidance): while a new schema
compiles, unconstrained requests keep producing tokens; a compile that outlives its
deadline fails its request alone; a second request with the same grammar takes the
cached compile. The compile thread runs the real compile; a gate holds its start, so
the assertions are about order and progress, never about how long anything takes."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from pdserve.engine.grammar import GrammarCompiler
from pdserve.engine.pending_grammars import PendingGrammars
from pdserve.engine.sampling_params import SamplingParams
from pdserve.node.structured_output import json_grammar

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {"colour": {"type": "string", "maxLength": 12}, "count": {"type": "integer"}},
    "required": ["colour", "count"],
    "additionalProperties": False,
}


class GatedExecutor(ThreadPoolExecutor):
    """One worker thread that starts each (real) compile only once `gate` is set."""

    def __init__(self):
        super().__init__(1, thread_name_prefix="gated-compile")
        self.gate = threading.Event()

    def submit(self, fn, /, *args, **kwargs):
        return super().submit(self._after_gate, fn, *args, **kwargs)

    def _after_gate(self, fn, *args, **kwargs):
        if not self.gate.wait(300):
            raise TimeoutError("the test never opened the gate")
        return fn(*args, **kwargs)


@pytest.fixture(scope="module")
def llm():
    from pdserve.engine import LLM

    return LLM("smollm2-135m-instruct", kv_cache_bytes=64 << 20, num_threads=1)


def gated_compiler(llm, **kw) -> GatedExecutor:
    core = llm.engine
    ex = GatedExecutor()
    compiler = GrammarCompiler(
        str(core.model_dir), core.vocab_size, sorted(core.eos_token_ids), executor=ex, **kw
    )
    core.grammars = PendingGrammars(compiler)
    return ex


def run(core, outs: dict, until, max_steps: int = 2000) -> None:
    for _ in range(max_steps):
        if until():
            return
        for o in core.step():
            got = outs.setdefault(o.request_id, {"ids": [], "finish": None, "error": None})
            got["ids"] += o.new_token_ids
            got["finish"], got["error"] = o.finish_reason, o.error
        time.sleep(0.001)
    raise AssertionError(f"not reached in {max_steps} steps: {outs}")


def ids(llm, text: str) -> list[int]:
    return llm.tokenizer.encode(text, add_special_tokens=False)


def test_unconstrained_tokens_flow_while_a_schema_compiles(llm):
    core, outs = llm.engine, {}
    ex = gated_compiler(llm)
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    core.add_request("plain", ids(llm, "Once upon a time"), plain)
    grammar = json_grammar(SCHEMA, "response_format")
    constrained = SamplingParams(temperature=0, max_tokens=40, grammar=grammar)
    core.add_request("json", ids(llm, "A JSON object about a box:"), constrained)  # returns
    assert core.stats().grammars_compiling == 1
    # the whole unconstrained request runs while the schema's compile has not even started
    run(core, outs, lambda: outs.get("plain", {}).get("finish") is not None)
    assert len(outs["plain"]["ids"]) == 12 and "json" not in outs
    assert core.stats().grammars_compiling == 1
    ex.gate.set()
    run(core, outs, lambda: outs.get("json", {}).get("finish") is not None)
    assert outs["json"]["finish"] == "stop", outs["json"]
    obj = json.loads(llm.tokenizer.decode(outs["json"]["ids"], skip_special_tokens=True))
    assert set(obj) == {"colour", "count"} and isinstance(obj["count"], int)
    # the same grammar again: the cached compile, scheduled at once
    core.add_request("json2", ids(llm, "Another box:"), constrained)
    assert core.stats().grammars_compiling == 0
    run(core, outs, lambda: outs.get("json2", {}).get("finish") is not None)
    json.loads(llm.tokenizer.decode(outs["json2"]["ids"], skip_special_tokens=True))
    core.check_integrity()


def test_a_compile_past_its_deadline_fails_only_its_request(llm):
    core, outs = llm.engine, {}
    ex = gated_compiler(llm, deadline_s=0.5)  # the gate stays shut: the deadline passes
    grammar = json_grammar({"type": "array", "items": {"type": "integer"}}, "response_format")
    core.add_request("stuck", ids(llm, "Numbers:"), SamplingParams(max_tokens=8, grammar=grammar))
    core.add_request("plain2", ids(llm, "Hello"), SamplingParams(temperature=0, max_tokens=4))
    run(core, outs, lambda: outs.get("stuck", {}).get("finish") is not None)
    assert outs["stuck"]["finish"] == "error" and "not compiled in 0.5 s" in outs["stuck"]["error"]
    assert outs["stuck"]["ids"] == []
    run(core, outs, lambda: outs.get("plain2", {}).get("finish") is not None)
    assert len(outs["plain2"]["ids"]) == 4
    assert core.stats().grammars_compiling == 0
    core.check_integrity()
    # an abort while compiling removes the wait as well
    core.add_request(
        "aborted", ids(llm, "Numbers:"), SamplingParams(max_tokens=8, grammar=grammar + " ")
    )
    assert core.stats().grammars_compiling == 1
    core.abort_requests(["aborted"])
    assert core.stats().grammars_compiling == 0 and not core.has_unfinished
    ex.gate.set()
    core.check_integrity()
