"""A minimal prefill -> decode proxy in front of two `vllm serve` instances (NixlConnector),
so `pdserve bench serve` can load vLLM's 1P1D the way it loads pdserve's.

Each `/v1/completions` request goes first to the prefill instance with `max_tokens: 1` and
`kv_transfer_params: {"do_remote_decode": true}` (vLLM keeps the KV and answers with the
parameters the decode side needs), then to the decode instance with those parameters; the
decode answer (SSE or JSON) is streamed back unchanged. Written for benchmarking only.

    python -m benchmarks._vllm_pd_proxy --prefill http://127.0.0.1:18001 \
        --decode http://127.0.0.1:18002 --port 18000
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import AsyncIterator

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

logger = logging.getLogger(__name__)
TIMEOUT = httpx.Timeout(1800.0, connect=10.0)


def build_app(prefill: str, decode: str) -> FastAPI:
    app = FastAPI()
    client = httpx.AsyncClient(timeout=TIMEOUT, limits=httpx.Limits(max_connections=None))

    @app.get("/v1/models")
    async def models() -> Response:
        r = await client.get(f"{decode}/v1/models")
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await request.json()
        first = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        first.update(max_tokens=1, min_tokens=0, stream=False,
                     kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False})  # fmt: skip
        r = await client.post(f"{prefill}/v1/completions", json=first)
        if r.status_code != 200:
            return Response(r.content, status_code=r.status_code, media_type="application/json")
        params = r.json().get("kv_transfer_params")
        if not params:
            return JSONResponse({"error": {"message": "prefill returned no kv_transfer_params",
                                           "type": "server_error"}}, status_code=502)  # fmt: skip
        second = {**body, "kv_transfer_params": params}
        if not body.get("stream"):
            r = await client.post(f"{decode}/v1/completions", json=second)
            return Response(r.content, status_code=r.status_code, media_type="application/json")

        async def relay() -> AsyncIterator[bytes]:
            async with client.stream("POST", f"{decode}/v1/completions", json=second) as s:
                async for chunk in s.aiter_raw():
                    yield chunk

        return StreamingResponse(relay(), media_type="text/event-stream")

    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--prefill", required=True, help="base URL of the prefill vllm serve")
    ap.add_argument("--decode", required=True, help="base URL of the decode vllm serve")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=18000)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO)
    uvicorn.run(build_app(args.prefill, args.decode), host=args.host, port=args.port,
                log_level="warning")  # fmt: skip


if __name__ == "__main__":
    main()
