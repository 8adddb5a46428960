"""Cost of structured output and gain of n > 1, on the offline engine (default model).

    python benchmarks/openai_features.py --out results/openai_features.json

1. Constrained vs unconstrained batch: B chat prompts, greedy, `max_tokens` new tokens
   each (EOS ignored, so both batches decode the same number of steps), once with no
   grammar and once with a JSON schema on every row; output tokens/s of each, measured
   alternately `--repeats` times (medians), and the share of the constrained runs' wall
   time spent computing and applying grammar masks (robust to a noisy machine, where
   the two wall times swing more than the difference). Also the sampler alone.
2. n = 4 vs 4 separate requests: one long prompt, 4 samples of `--n-tokens` tokens.
   "n4" submits the 4 sequences together (what a node does for n=4: the prompt's full
   blocks are computed once, the others hit the prefix cache); "separate" runs 4
   requests one after another on an engine without prefix caching (each computes the
   whole prompt). Wall time of each, medians.
Side by side in one process, so the ratios hold on a noisy machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pdserve.engine.sampler as sampler_mod  # noqa: E402
from pdserve.engine import LLM, SamplingParams  # noqa: E402
from pdserve.engine.request import Request  # noqa: E402
from pdserve.engine.sampler import sample  # noqa: E402
from pdserve.node.structured_output import json_grammar  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "story": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "story", "tags"],
}
KV_BYTES = 96 << 20
TOPICS = ["a chef", "a pilot", "a child", "a painter", "a farmer", "a doctor", "a student", "a cat"]


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def constrained_vs_not(llm: LLM, batch: int, max_tokens: int, repeats: int) -> dict:
    grammar = json_grammar(SCHEMA, "bench")
    chats = [
        [{"role": "user", "content": f"Describe {TOPICS[i % 8]} as JSON."}] for i in range(batch)
    ]
    plain = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    json_p = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, grammar=grammar)
    llm.chat(chats[:1], json_p)  # warm: builds the grammar tokenizer once
    tps: dict[str, list[float]] = {"unconstrained": [], "json_schema": []}
    share: list[float] = []  # logits processing (grammar masks) / wall time, constrained runs
    spent = [0.0]
    inner = sampler_mod.process_logits

    def counting(logits, reqs):
        t0 = time.perf_counter()
        out = inner(logits, reqs)
        spent[0] += time.perf_counter() - t0
        return out

    sampler_mod.process_logits = counting
    try:
        for _ in range(repeats):
            for name, p in (("unconstrained", plain), ("json_schema", json_p)):
                spent[0] = 0.0
                t = timed(lambda p=p: llm.chat(chats, p))
                tps[name].append(batch * max_tokens / t)
                if name == "json_schema":
                    share.append(100 * spent[0] / t)
    finally:
        sampler_mod.process_logits = inner
    med = {k: statistics.median(v) for k, v in tps.items()}
    return {
        "batch": batch,
        "max_tokens": max_tokens,
        "tok_s": med,
        "json_schema_cost_pct_wall": 100 * (1 - med["json_schema"] / med["unconstrained"]),
        "grammar_share_of_wall_pct": statistics.median(share),
        "sampler_ms": sampler_cost(llm, batch, grammar),
    }


def sampler_cost(llm: LLM, batch: int, grammar: str) -> dict:
    """The sampler alone on [batch, V] logits: no grammar vs a grammar on every row."""
    vocab = llm.engine.vocab_size
    logits = torch.randn(batch, vocab)
    plain = [Request(f"p{i}", [1], SamplingParams(temperature=0), 16) for i in range(batch)]
    rows = []
    for i in range(batch):
        r = Request(f"g{i}", [1], SamplingParams(temperature=0, grammar=grammar), 16)
        compiler = llm.engine.grammars.compiler
        r.grammar = compiler.instantiate(compiler.submit(grammar))
        r.grammar.accept(llm.tokenizer.encode("{", add_special_tokens=False)[0])
        rows.append(r)
    out = {}
    for name, reqs in (("unconstrained", plain), ("json_schema", rows)):
        ts = []
        for _ in range(20):
            ts.append(timed(lambda reqs=reqs: sample(logits, reqs)))
            for r in reqs:  # undo the accepted token: the same mask work each time
                if r.grammar is not None:
                    r.grammar.matcher.rollback(1)
        out[name] = 1000 * statistics.median(ts)
    return out


def n4_vs_separate(model: str, threads: int, prompt_len: int, n_tokens: int, repeats: int) -> dict:
    cached = LLM(model, kv_cache_bytes=256 << 20, num_threads=threads)
    uncached = LLM(
        model, kv_cache_bytes=256 << 20, num_threads=threads, enable_prefix_caching=False
    )
    base = cached.tokenizer.encode("The history of the sea and its sailors. " * 200)
    wall: dict[str, list[float]] = {"n4": [], "separate": []}
    for rep in range(repeats):
        prompt = [base[rep], *base[1:prompt_len]]  # new first token: no cache across repeats
        params = [
            SamplingParams(temperature=1.0, seed=7 + i, max_tokens=n_tokens, ignore_eos=True)
            for i in range(4)
        ]
        wall["n4"].append(timed(lambda x=prompt, ps=params: cached.generate([x] * 4, ps)))
        wall["separate"].append(
            timed(lambda x=prompt, ps=params: [uncached.generate([x], p) for p in ps])
        )
    med = {k: statistics.median(v) for k, v in wall.items()}
    return {
        "prompt_tokens": prompt_len,
        "new_tokens_each": n_tokens,
        "wall_s": med,
        "speedup": med["separate"] / med["n4"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--n-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="results/openai_features.json")
    args = ap.parse_args()
    llm = LLM(args.model, kv_cache_bytes=KV_BYTES, num_threads=args.threads)
    result = {
        "constrained_vs_unconstrained": constrained_vs_not(
            llm, args.batch, args.max_tokens, args.repeats
        ),
        "n4_vs_separate": n4_vs_separate(
            args.model, args.threads, args.prompt_len, args.n_tokens, args.repeats
        ),
        "threads": args.threads,
    }
    print(json.dumps(result, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
