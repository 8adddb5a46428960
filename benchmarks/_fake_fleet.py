"""A fleet of light fake nodes for router benchmarks: real HTTP, real Redis registration, real
KV index publishing, no model.

Each fake node serves `/health`, `/v1/node`, `/v1/completions` and `/v1/chat/completions`
(token-id prompts; JSON or SSE), plus `/fake/stats` (requests it served), and answers at
model-derived latencies:

    TTFT = queue wait on the prefill node + uncached prompt tokens / prefill_tok_s
    then one token every tpot_s

A decode node given `kv_transfer_params.prefill_node` prefills on that fake prefill node
(found by its control address, in-process), else on itself. Each node keeps an LRU prefix
cache of block hashes (pdserve/common/block_hash.py) of `kv_blocks` blocks; stores and evictions
go to Redis through the real `KVIndexPublisher`, and a heartbeat writes its `NodeRecord`
under a TTL exactly as a real node does. All nodes of a fleet run in one process, each
with its own uvicorn server on its own port.

    python -m benchmarks._fake_fleet --redis-url redis://127.0.0.1:6379 --prefill 4 --decode 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import msgspec
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from redis.asyncio import Redis

from pdserve.cluster.kv_index import KVIndexPublisher
from pdserve.cluster.registry import NodeRecord
from pdserve.common.block_hash import hash_prompt_blocks, root_hash
from pdserve.common.cluster_secret import load_cluster_secret
from pdserve.common.redis_keys import ClusterKeys


@dataclass
class Timing:
    """Latencies of a small model on one accelerator (SmolLM2-135M class)."""

    prefill_tok_s: float = 50_000.0
    tpot_s: float = 0.004


@dataclass
class FakeNode:
    record: NodeRecord
    timing: Timing
    cache: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    busy_until: float = 0.0  # prefill queue: when the last queued prefill ends
    running: int = 0
    publisher: KVIndexPublisher | None = None
    served: int = 0
    extra_running: int = 0  # pinned load on top of the real one (policy tests)

    def report(self) -> NodeRecord:
        """Its record with the current load, as a real node reports it."""
        self.record.running = self.running + self.extra_running
        self.record.kv_used = len(self.cache)
        return self.record

    def hits(self, chain: list[bytes]) -> int:
        n = 0
        for h in chain:
            if h not in self.cache:
                break
            n += 1
        return n

    def store(self, chain: list[bytes]) -> None:
        """Cache a prompt's blocks; LRU, touched tail-first so that (as in the engine's block
        pool) a block's parent is never evicted before it."""
        stored, evicted = [], []
        for h in reversed(chain):
            if h in self.cache:
                self.cache.move_to_end(h)
            else:
                self.cache[h] = None
                stored.append(h)
        while len(self.cache) > self.record.kv_total:
            evicted.append(self.cache.popitem(last=False)[0])
        if self.publisher is not None:
            self.publisher.add(stored, evicted)

    def prefill_time(self, chain: list[bytes], n_tokens: int) -> float:
        """Queue this prompt's prefill; seconds until it ends."""
        uncached = n_tokens - self.hits(chain) * self.record.block_size
        now = time.monotonic()
        start = max(now, self.busy_until)
        self.busy_until = start + max(uncached, 1) / self.timing.prefill_tok_s
        self.store(chain)
        return self.busy_until - now


class Fleet:
    def __init__(self, redis_url: str, cluster: str, model: str, host: str, base_port: int):
        self.redis = Redis.from_url(redis_url)
        self.keys = ClusterKeys(cluster)
        self.model = model
        self.host = host
        self.base_port = base_port
        self.nodes: list[FakeNode] = []
        self.by_control: dict[str, FakeNode] = {}
        self.sockets: list[socket.socket] = []  # one bound listening socket per node

    def add(self, role: str, i: int, timing: Timing, kv_blocks: int, block_size: int) -> FakeNode:
        # proto IPPROTO_TCP, not the default 0: asyncio sets TCP_NODELAY only on accepted
        # sockets whose proto says TCP; without it, Nagle + delayed ACK add ~40 ms to every
        # answer on a reused (keep-alive) connection.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.base_port + len(self.nodes) if self.base_port else 0))
        port = sock.getsockname()[1]
        self.sockets.append(sock)
        rec = NodeRecord(
            node_id=f"fake-{role}-{i}",
            role=role,
            url=f"http://{self.host}:{port}",
            model=self.model,
            block_size=block_size,
            epoch=time.time_ns(),
            kv_control=f"tcp://{self.host}:{port}" if role == "prefill" else "",  # a name only
            max_model_len=8192,
            vocab_size=50_000,
            local_prefill_max_tokens=16 if role == "decode" else 0,
            kv_total=kv_blocks,
        )
        node = FakeNode(rec, timing)
        node.publisher = KVIndexPublisher(
            self.redis, self.keys.kv(rec.node_id, rec.epoch), 5.0, self._snapshot(node)
        )
        self.nodes.append(node)
        if rec.kv_control:
            self.by_control[rec.kv_control] = node
        return node

    @staticmethod
    def _snapshot(node: FakeNode):
        async def snapshot() -> list[bytes]:
            return list(node.cache)

        return snapshot

    @property
    def secret(self) -> bytes | None:
        """The cluster secret from the environment (PDSERVE_CLUSTER_SECRET): records signed."""
        return load_cluster_secret()

    async def heartbeat(self, period_s: float = 1.0, ttl_s: float = 5.0) -> None:
        while True:
            pipe = self.redis.pipeline(transaction=False)
            for n in self.nodes:
                n.report().updated = time.time()
                mapping = n.record.to_redis(self.secret)  # signed with a cluster secret
                pipe.hset(self.keys.node(n.record.node_id), mapping=mapping)
                pipe.pexpire(self.keys.node(n.record.node_id), int(ttl_s * 1000))
                pipe.sadd(self.keys.nodes, n.record.node_id)
                pipe.pexpire(n.publisher.key, int(ttl_s * 1000))
            await pipe.execute()
            await asyncio.sleep(period_s)

    def app(self, node: FakeNode) -> FastAPI:
        app = FastAPI()
        enc = json.dumps

        @app.get("/health")
        async def health() -> dict:
            return {"status": "ok"}

        @app.get("/v1/node")
        async def info() -> Response:
            return Response(msgspec.json.encode(node.report()), media_type="application/json")

        @app.get("/fake/stats")
        async def stats() -> dict:
            return {"node_id": node.record.node_id, "served": node.served}

        async def generate(request: Request, chat: bool) -> Response:
            body = await request.json()
            tokens = body.get("prompt_token_ids") if chat else body.get("prompt")
            max_tokens = int(body.get("max_tokens") or 16)
            rec = node.record
            chain = hash_prompt_blocks(
                tokens, rec.block_size, root_hash(rec.model, rec.block_size, "", rec.weights)
            )
            hit = node.hits(chain) * rec.block_size
            prefill = (body.get("kv_transfer_params") or {}).get("prefill_node")
            where = self.by_control.get(prefill, node) if prefill else node
            node.running += 1
            ttft = where.prefill_time(chain, len(tokens))
            node.store(chain)
            node.served += 1
            rid = f"cmpl-fake-{node.served}"
            usage = {"prompt_tokens": len(tokens), "completion_tokens": max_tokens,
                     "total_tokens": len(tokens) + max_tokens,
                     "prompt_tokens_details": {"cached_tokens": hit}}  # fmt: skip
            tpot = node.timing.tpot_s
            if not body.get("stream"):
                try:
                    await asyncio.sleep(ttft + tpot * (max_tokens - 1))
                finally:
                    node.running -= 1
                choice = {"index": 0, "text": "x" * max_tokens, "finish_reason": "length"}
                return JSONResponse({"id": rid, "object": "text_completion", "model": rec.model,
                                     "choices": [choice], "usage": usage})  # fmt: skip

            async def events():
                try:
                    await asyncio.sleep(ttft)
                    for i in range(max_tokens):
                        if i:
                            await asyncio.sleep(tpot)
                        done = "length" if i == max_tokens - 1 else None
                        c = {"index": 0, "text": "x", "finish_reason": done}
                        yield f"data: {enc({'id': rid, 'choices': [c]})}\n\n"
                    if (body.get("stream_options") or {}).get("include_usage"):
                        yield f"data: {enc({'id': rid, 'choices': [], 'usage': usage})}\n\n"
                    yield "data: [DONE]\n\n"
                finally:
                    node.running -= 1

            return StreamingResponse(events(), media_type="text/event-stream")

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await generate(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            return await generate(request, chat=True)

        return app

    async def serve(self) -> None:
        servers = []
        for node in self.nodes:
            config = uvicorn.Config(
                self.app(node), log_level="warning", access_log=False, lifespan="off"
            )
            servers.append(uvicorn.Server(config))
        for s in servers:
            s.install_signal_handlers = lambda: None
        tasks = [
            asyncio.create_task(s.serve(sockets=[sock])) for s, sock in zip(servers, self.sockets)
        ]
        tasks.append(asyncio.create_task(self.heartbeat()))
        tasks += [asyncio.create_task(n.publisher.run()) for n in self.nodes]
        await asyncio.gather(*tasks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--redis-url", required=True)
    ap.add_argument("--cluster", default="pdserve")
    ap.add_argument("--model", default="fake")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--base-port", type=int, default=0, help="0: free ports")
    ap.add_argument("--prefill", type=int, default=4)
    ap.add_argument("--decode", type=int, default=4)
    ap.add_argument(
        "--first-index", type=int, default=0,
        help="number of the first node of each role (several fleet processes, one cluster)",
    )  # fmt: skip
    ap.add_argument("--kv-blocks", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--prefill-tok-s", type=float, default=Timing.prefill_tok_s)
    ap.add_argument("--tpot-s", type=float, default=Timing.tpot_s)
    ap.add_argument(
        "--decode-load",
        default="",
        help="comma-separated running requests that decode nodes 0, 1, ... report on top of "
        "their real load (to test load-based policies)",
    )
    args = ap.parse_args()
    timing = Timing(args.prefill_tok_s, args.tpot_s)
    loads = [int(x) for x in args.decode_load.split(",") if x.strip()]
    fleet = Fleet(args.redis_url, args.cluster, args.model, args.host, args.base_port)
    for role, count in (("prefill", args.prefill), ("decode", args.decode)):
        for i in range(args.first_index, args.first_index + count):
            node = fleet.add(role, i, timing, args.kv_blocks, args.block_size)
            if role == "decode" and 0 <= i - args.first_index < len(loads):
                node.extra_running = loads[i - args.first_index]
    asyncio.run(fleet.serve())


if __name__ == "__main__":
    main()
