"""The node API process's Python per streamed token, without HTTP or an engine.

    python benchmarks/api_stream_path.py --streams 64 --tokens 128 --rounds 5

Drives `stream_completion` / `stream_chat` (node/openai_responses.py) for N streams at once,
fed by a stand-in engine client that puts one output per stream per "step" on each
request's queue, as `EngineCoreClient` does, and reports this process's CPU microseconds
per token (best and median of the rounds): `AsyncLLM.generate` (detokenizer included),
`OpenAIServing`'s deltas and metrics, and the SSE chunk strings. What a node adds on top
(ZMQ receive, Starlette's send chain, the socket write) is left out; benchmarks/node_cpu.py
measures the whole process.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pdserve.api.protocol import ChatCompletionRequest, CompletionRequest  # noqa: E402
from pdserve.common.model_files import resolve_model  # noqa: E402
from pdserve.engine.async_llm import AsyncLLM  # noqa: E402
from pdserve.engine.messages import Ready  # noqa: E402
from pdserve.engine.outputs import EngineCoreOutput  # noqa: E402
from pdserve.engine.tokenizer import load_tokenizer  # noqa: E402
from pdserve.node import openai_responses as responses  # noqa: E402
from pdserve.node.metrics import NodeMetrics  # noqa: E402
from pdserve.node.openai_serving import OpenAIServing  # noqa: E402


class StandInClient:
    """`EngineCoreClient`'s request side: a queue per request, nothing sent anywhere."""

    def __init__(self) -> None:
        self.queues: dict[str, asyncio.Queue] = {}

    def add_request(self, request_id, prompt_token_ids, params, remote_prefill=None):
        q: asyncio.Queue = asyncio.Queue()
        self.queues[request_id] = q
        return q

    def abort_requests(self, request_ids) -> None:
        pass


def make_llm(model: str) -> AsyncLLM:
    model_dir = resolve_model(model)
    llm = AsyncLLM.__new__(AsyncLLM)  # no engine process: the stand-in client feeds it
    llm.client = StandInClient()
    llm.tokenizer = load_tokenizer(model_dir)
    llm.info = Ready(
        model_dir=str(model_dir), max_model_len=4096, vocab_size=len(llm.tokenizer),
        eos_token_ids=[], block_size=16, num_blocks=1024,
    )  # fmt: skip
    return llm


async def one_round(s: OpenAIServing, chat: bool, streams: int, tokens: int, rng) -> float:
    """CPU microseconds per token of one round."""
    client: StandInClient = s.llm.client
    client.queues.clear()
    gens = []
    for _ in range(streams):
        common = dict(model=s.model_name, max_tokens=tokens, stream=True, ignore_eos=True,
                      stream_options={"include_usage": True})  # fmt: skip
        if chat:
            req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **common)
            gens.append(responses.stream_chat(s, s.prepare_chat(req), True))
        else:
            prompt = [rng.randrange(100, 40000) for _ in range(128)]
            req = CompletionRequest(prompt=prompt, **common)
            gens.append(responses.stream_completion(s, s.prepare_completion(req), True))

    async def consume(gen) -> None:
        async for event in gen:
            event.encode()  # what Starlette does with each str chunk

    tasks = [asyncio.create_task(consume(g)) for g in gens]
    await asyncio.sleep(0)  # every stream submits its request
    ids = [[rng.randrange(100, 40000) for _ in range(tokens)] for _ in range(streams)]
    rids = list(client.queues)
    cpu = time.process_time()
    for step in range(tokens):
        now = time.monotonic()
        finish = "length" if step == tokens - 1 else None
        for j, rid in enumerate(rids):
            out = EngineCoreOutput(request_id=rid, new_token_ids=[ids[j][step]],
                                   finish_reason=finish, num_prompt_tokens=128)  # fmt: skip
            client.queues[rid].put_nowait((now, out))
        for _ in range(3):  # let every stream take its token
            await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    return (time.process_time() - cpu) / (streams * tokens) * 1e6


async def run(args) -> None:
    s = OpenAIServing(make_llm(args.model), NodeMetrics(), "bench")
    rng = random.Random(0)
    for kind in args.kinds:
        us = [await one_round(s, kind == "chat", args.streams, args.tokens, rng)
              for _ in range(args.rounds)]  # fmt: skip
        print(f"{kind}: {min(us):.1f} us/token best, {statistics.median(us):.1f} median")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="its tokenizer is used")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--kinds", nargs="+", default=["completions", "chat"])
    args = p.parse_args()
    logging.disable(logging.INFO)  # a line per finished request otherwise
    try:
        import uvloop  # what uvicorn runs the node on

        uvloop.run(run(args))
    except ImportError:
        asyncio.run(run(args))


if __name__ == "__main__":
    main()
