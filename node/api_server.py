"""The node's FastAPI app: OpenAI routes, health, metrics, debug, and OpenAI-style errors.

`build_app()` makes an app whose lifespan starts the `AsyncLLM` (and so the EngineCore
process) and shuts it down with the server. Every error leaves as
`{"error": {"message", "type", "param", "code"}}` with a 4xx/5xx status. A client that
disconnects aborts its request in the engine, streaming or not.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pdserve.api.body_deadline import DEFAULT_BODY_TIMEOUT_S, BodyDeadlineMiddleware
from pdserve.api.cluster_secret import NodeKeyMiddleware
from pdserve.api.http import (
    DEFAULT_MAX_BODY_BYTES,
    AbortOnDisconnectResponse,
    BodySizeLimitMiddleware,
    add_error_handlers,
    error_response,
    trace_id,
    until_disconnect,
)
from pdserve.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from pdserve.api.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from pdserve.common.errors import InvalidRequestError
from pdserve.common.request_cost import CostLimits
from pdserve.common.sampling_rules import check_token_ids
from pdserve.config.node import HTTPSettings
from pdserve.engine.async_llm import AsyncLLM, RequestFailedError
from pdserve.engine.config import EngineConfig
from pdserve.engine.core_client import EngineDeadError
from pdserve.engine.grammar_check import GrammarCheckPool, GrammarWorkersBusy
from pdserve.engine.messages import EngineAddresses, OutputBatch
from pdserve.node import openai_responses as responses
from pdserve.node.cluster_agent import ClusterAgent, ClusterOptions
from pdserve.node.metrics import NodeMetrics
from pdserve.node.openai_serving import ModelNotFoundError, OpenAIServing
from pdserve.node.prefill_nodes import PrefillNodes
from pdserve.node.resume import TOKEN_IDS_HEADER
from pdserve.node.roles import build_kv

logger = logging.getLogger(__name__)

ENGINE_WATCH_S = 0.2  # how often the node checks that its EngineCore lives
EXIT_ENGINE_DEAD = 3  # `pdserve serve`'s exit code when its engine died


def build_app(
    config: EngineConfig,
    addresses: EngineAddresses,
    served_model_name: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    health_timeout_s: float = 10.0,
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    prefill_nodes: PrefillNodes | None = None,
    cluster: ClusterOptions | None = None,
    limits: CostLimits | None = None,
    grammar_deadline_s: float | None = None,
    grammar_workers: int | None = None,
) -> FastAPI:
    """`prefill_nodes` (decode role): where requests may be prefilled; default: the
    configured `kv_transfer.prefill_nodes` (see node/prefill_nodes.py for the hook), plus,
    with `cluster.redis_url`, the prefill nodes of this model in the registry."""
    model_name = served_model_name or config.model.api_name
    cluster = cluster or ClusterOptions(advertise_url="http://127.0.0.1")
    registry_prefills: set[str] = set()  # kept current by the cluster agent
    if prefill_nodes is None and cluster.redis_url:
        configured = tuple(config.kv_transfer.prefill_nodes)
        prefill_nodes = PrefillNodes(
            lambda: registry_prefills.union(configured), config.kv_transfer.role
        )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        llm = AsyncLLM(config, addresses, build_kv)
        metrics = NodeMetrics()
        agent = ClusterAgent(config, llm, cluster, registry_prefills)

        def on_batch(batch: OutputBatch) -> None:
            metrics.update_engine(batch.stats)
            agent.on_batch(batch)

        llm.client.on_batch = on_batch
        app.state.llm = llm
        app.state.agent = agent
        app.state.metrics = metrics
        app.state.serving = OpenAIServing(
            llm, metrics, model_name, config.kv_transfer, prefill_nodes, limits
        )
        watch = pool = None
        try:
            await llm.start()
            http = HTTPSettings()
            app.state.serving.plans.pool = pool = GrammarCheckPool(
                llm.info.model_dir,
                llm.info.vocab_size,
                llm.info.eos_token_ids,
                grammar_workers or http.grammar_workers,
                grammar_deadline_s or http.grammar_deadline_s,
            )
            await agent.start()
            watch = asyncio.create_task(_exit_when_engine_dies(app, llm, agent), name="engine")
            # What startup made (torch, transformers, the tokenizer, the app) lives as long
            # as the process: out of the collector's sight. Else a full collection, which
            # the streams' allocations trigger now and then, walks it all with every stream
            # paused (docs/benchmarks-history.md, "Online node: CPU outside the forward"),
            # as in the router.
            gc.collect()
            gc.freeze()
            logger.info("serving %s (max_model_len=%d)", model_name, llm.max_model_len)
            yield
        finally:
            if watch is not None:
                watch.cancel()
            await agent.stop()
            await llm.shutdown()
            if pool is not None:
                pool.close()

    app = FastAPI(title="pdserve node", lifespan=lifespan)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_body_bytes)
    app.add_middleware(NodeKeyMiddleware, secret=config.kv_transfer.cluster_secret)
    app.add_middleware(BodyDeadlineMiddleware, timeout_s=body_timeout_s)  # outermost
    _add_error_handlers(app)

    @app.get("/health")
    async def health(request: Request) -> Response:
        """200 only while the engine loop answers: a dead or stuck engine is a 503."""
        llm: AsyncLLM = request.app.state.llm
        if llm.client.dead is not None:
            return error_response(503, llm.client.dead, "server_error", code="engine_dead")
        try:
            with anyio.fail_after(health_timeout_s):
                await llm.get_stats()
        except TimeoutError:
            msg = f"the engine loop has not answered for {health_timeout_s:g} s"
            return error_response(503, msg, "server_error", code="engine_unresponsive")
        except EngineDeadError as e:
            return error_response(503, str(e), "server_error", code="engine_dead")
        return JSONResponse({"status": "ok"})

    @app.get("/v1/node")
    async def node_info(request: Request) -> Response:
        """This node's registry record (role, urls, model, block size, epoch, load) and
        its engine's progress, `engine: {steps, busy}` (output batches received so far,
        at least one a second while its loop runs with work; whether it holds unfinished
        requests): a router takes a busy engine whose steps do
        not advance for stuck. A dead engine: 503 `engine_dead`."""
        client = request.app.state.llm.client
        if client.dead is not None:
            return error_response(503, client.dead, "server_error", code="engine_dead")
        engine = {"steps": client.num_batches, "busy": client.num_open > 0}
        body = msgspec.to_builtins(request.app.state.agent.record()) | {"engine": engine}
        return Response(msgspec.json.encode(body), media_type="application/json")

    @app.get("/v1/models")
    async def models(request: Request) -> ModelList:
        return ModelList(
            data=[ModelCard(id=model_name, max_model_len=request.app.state.llm.max_model_len)]
        )

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        state = request.app.state
        try:
            with anyio.fail_after(5):
                state.metrics.update_engine(await state.llm.get_stats())
        except (TimeoutError, EngineDeadError):
            pass  # serve the last stats seen
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/debug/engine")
    async def debug_engine(request: Request) -> JSONResponse:
        llm: AsyncLLM = request.app.state.llm
        violation, requests = await llm.client.debug_state()
        stats = await llm.get_stats()
        return JSONResponse(
            {
                "stats": {f: getattr(stats, f) for f in stats.__struct_fields__},
                "integrity": {"ok": violation is None, "error": violation},
                # every request the engine holds, and those this process still streams
                "requests": msgspec.to_builtins(requests),
                "open_here": sorted(llm.client.open_request_ids),
            }
        )

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        serving: OpenAIServing = request.app.state.serving
        plan = await serving.plans.plan(body)  # compiles a schema off the event loop
        p = await serving.prepare_completion(body, trace_id(request.headers), plan)
        p.emit_ids = request.headers.get(TOKEN_IDS_HEADER) == "1"
        return await _generate(
            request, body, p, responses.stream_completion, responses.completion_response
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        serving: OpenAIServing = request.app.state.serving
        plan = await serving.plans.plan(body)
        p = await serving.prepare_chat(body, trace_id(request.headers), plan)
        p.emit_ids = request.headers.get(TOKEN_IDS_HEADER) == "1"
        return await _generate(request, body, p, responses.stream_chat, responses.chat_response)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
        serving: OpenAIServing = request.app.state.serving
        serving.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequestError("send exactly one of prompt and messages", "prompt")
        if body.messages is not None:
            ids = serving.chat_ids(
                [m.to_template_dict() for m in body.messages], body.add_generation_prompt
            )
        else:
            ids = serving.encode(body.prompt or "", body.add_special_tokens)
        strs = [serving.fmt.token_str(t) for t in ids] if body.return_token_strs else None
        return TokenizeResponse(
            count=len(ids), max_model_len=serving.llm.max_model_len, tokens=ids, token_strs=strs
        )

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
        serving: OpenAIServing = request.app.state.serving
        serving.check_model(body.model)
        check_token_ids(body.tokens, serving.llm.info.vocab_size, "tokens")
        if serving.llm.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer", "tokens")
        return DetokenizeResponse(prompt=serving.llm.tokenizer.decode(body.tokens))

    return app


async def _exit_when_engine_dies(app: FastAPI, llm: AsyncLLM, agent: ClusterAgent) -> None:
    """A node whose EngineCore is gone serves nothing: it leaves the registry and exits
    (the open requests already got their terminal error), so whatever runs it (the
    launcher's supervisor, systemd, Kubernetes) starts a fresh one. The drain (as on
    SIGTERM) answers what arrives meanwhile with a 503; `pdserve serve` exits with
    `EXIT_ENGINE_DEAD`, by the drain's deadline at the latest (api/drain.py). Leaving the
    registry is bounded (`ClusterAgent.stop`) and never keeps the drain from starting: a
    node that stayed up with a dead engine was never restarted."""
    while llm.client.dead is None:
        await asyncio.sleep(ENGINE_WATCH_S)
    logger.error("the engine is dead (%s): leaving the registry and exiting", llm.client.dead)
    app.state.engine_died = llm.client.dead
    try:
        await agent.stop()
    finally:
        drain = getattr(app.state, "drain", None)  # api/drain.py, which `pdserve serve` runs
        if drain is not None and drain.stop is not None:
            drain.stop()  # `serve` returns: `pdserve serve` exits with EXIT_ENGINE_DEAD
        else:
            os.kill(os.getpid(), signal.SIGTERM)


async def _generate(request: Request, body, p, stream_fn, response_fn) -> Response:
    """Serve a prepared request: an SSE stream, or one JSON body (499 if the client left)."""
    serving: OpenAIServing = request.app.state.serving
    p.drain = getattr(request.app.state, "drain", None)
    if body.stream:
        return AbortOnDisconnectResponse(
            stream_fn(serving, p, body.include_usage), media_type="text/event-stream"
        )
    gens = await until_disconnect(request, serving.collect(p))
    if gens is None:
        return Response(status_code=499)
    out = response_fn(serving, p, gens).model_dump()
    return JSONResponse(out | _timings_field(serving, gens))


def _timings_field(serving: OpenAIServing, gens) -> dict:
    """`pdserve_timings` of the first choice, for a non-streamed response body."""
    t = serving.server_timings(gens[0]) if gens else None
    return {"pdserve_timings": t} if t is not None else {}


def _add_error_handlers(app: FastAPI) -> None:
    add_error_handlers(app)

    @app.exception_handler(ModelNotFoundError)
    async def model_not_found(request: Request, exc: ModelNotFoundError) -> JSONResponse:
        return error_response(404, str(exc), param="model", code="model_not_found")

    @app.exception_handler(GrammarWorkersBusy)
    async def grammar_busy(request: Request, exc: GrammarWorkersBusy) -> JSONResponse:
        msg = "every structured-output compile worker stayed busy: retry later"
        return error_response(429, msg, "rate_limit_error", code="grammar_workers_busy")

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(503, str(exc), "server_error", code="engine_dead")

    @app.exception_handler(RequestFailedError)
    async def request_failed(request: Request, exc: RequestFailedError) -> JSONResponse:
        if request.app.state.llm.client.dead is not None:  # a node fault, not this request's
            return error_response(503, str(exc), "server_error", code="engine_dead")
        return error_response(500, str(exc), "server_error", code="engine_error")
