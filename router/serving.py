"""The router's two generation endpoints: check and tokenize once, choose nodes, forward, relay.

A request is checked here as a node would check it (same error bodies), so bad input
never reaches a node: the OpenAI schema, the model name, unsupported fields, the prompt
against the context length and vocabulary the nodes report. The node gets token ids
(`prompt` for completions, `prompt_token_ids` for chat), the client's sampling fields and,
for a PD decode node, `kv_transfer_params.prefill_node` = the chosen prefill node's control
address; a client that names a prefill node itself gets a 400 (clients never choose where a
node connects). `X-Request-Id` (the client's, if it sent a sane one, else a new one) goes to
every node with `X-Attempt`; a retry is a new attempt on another node.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math

from fastapi import Request
from fastapi.responses import Response

from pdserve.api.chat_tools import template_tools
from pdserve.api.http import error_response, until_disconnect
from pdserve.api.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.common.errors import InvalidRequestError
from pdserve.common.off_loop import off_loop, text_size
from pdserve.common.request_cost import meter_for
from pdserve.common.sampling_rules import INT32_MAX, check_sampling_values, check_token_ids
from pdserve.router.buffered import collect
from pdserve.router.client_watch import ClientWatch
from pdserve.router.config import RouterConfig
from pdserve.router.metrics import RouterMetrics
from pdserve.router.migration import TOKEN_IDS_HEADER, StreamContext, StreamRelay
from pdserve.router.relay import (
    AttemptFailed,
    NodeAnswer,
    cached_tokens,
    encode_body,
    open_stream,
    send_json,
)
from pdserve.router.request_ids import RequestIds
from pdserve.router.selector import Decision, Selector
from pdserve.router.stream_watch import StreamWatch
from pdserve.router.streamed import WATCH, Relayed, RelayResponse, Release
from pdserve.router.token_budget import TokenBudget, client_key
from pdserve.router.tokenizer import RouterTokenizer

logger = logging.getLogger(__name__)


_COMPLETION_PROMPT = frozenset({"kv_transfer_params", "prompt"})
_CHAT_PROMPT = frozenset({"kv_transfer_params", "messages", "prompt_token_ids"})


class ModelNotFoundError(LookupError):
    def __init__(self, model: str):
        super().__init__(f"the model {model!r} does not exist on this node")


class NoNodeError(RuntimeError):
    """No usable node can take the request (HTTP 503)."""


class RouterServing:
    def __init__(
        self,
        config: RouterConfig,
        selector: Selector,
        tokenizer: RouterTokenizer | None,
        metrics: RouterMetrics,
    ):
        self.config = config
        self.selector = selector
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.request_id = RequestIds()
        self.watch = StreamWatch(config.migrate_silent_after_s)  # run by the app's lifespan
        self.budget = TokenBudget(
            config.prompt_tokens_per_minute_per_key, config.max_prompt_tokens_per_request
        )

    # -- checks and tokens ------------------------------------------------------------------
    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.api_name:
            raise ModelNotFoundError(model)

    async def completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        """Token ids of each prompt (one, or a batch: the node answers every prompt),
        charged to the request's cost limits prompt by prompt: a prompt is tokenized only
        while the request still fits (pdserve/common/request_cost.py)."""
        self._check_model(req.model)
        prompts = req.prompts()
        meter = meter_for(req, self.config.cost_limits, len(prompts))
        if any(isinstance(p, str) for p in prompts) and self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: send token ids", "prompt")
        out = []
        for p in prompts:
            ids = p if isinstance(p, list) else await off_loop(len(p), self.tokenizer.encode, p)
            meter.add_prompt(len(ids))
            out.append(ids)
        return out

    async def chat_tokens(self, req: ChatCompletionRequest) -> list[int]:
        self._check_model(req.model)
        meter = meter_for(req, self.config.cost_limits)
        if req.prompt_token_ids is not None:
            meter.add_prompt(len(req.prompt_token_ids))
            return req.prompt_token_ids
        if not req.messages:
            raise InvalidRequestError("messages must not be empty", "messages")
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: chat needs one", "messages")
        messages, extra = template_tools(req, self.tokenizer.chat_template)  # as a node does
        try:
            ids = await off_loop(
                text_size(messages), self.tokenizer.apply_chat_template, messages,
                extra.get("tools"),
            )  # fmt: skip
        except Exception as e:  # the template itself may reject a conversation
            raise InvalidRequestError(
                f"the chat template rejected the messages: {e}", "messages"
            ) from e
        meter.add_prompt(len(ids))
        return ids

    def check_prompt(self, tokens: list[int], max_tokens: int | None) -> tuple[int, int] | None:
        """What a node would reject, checked against the limits nodes report (same messages).

        Returns the (max_model_len, vocab_size) it checked against; None when no node has
        been seen yet (then the node checks)."""
        if not tokens:
            raise InvalidRequestError("the prompt is empty", "prompt")
        limits = self.selector.view.limits()
        if limits is None:
            return None
        max_len, vocab = limits
        n = len(tokens)
        if n >= max_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {max_len} tokens; "
                f"the prompt has {n} tokens (it must leave room for at least one new token)",
                "prompt",
            )
        if max_tokens is not None and n + max_tokens > max_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {max_len} tokens; "
                f"the prompt has {n} tokens and max_tokens asks for {max_tokens} more",
                "max_tokens",
            )
        check_token_ids(tokens, vocab, "prompt")
        return limits

    @staticmethod
    def check_sampling(req, tokens: list[int], limits: tuple[int, int] | None) -> dict:
        """The node's sampling checks, in its order: API fields, value rules, token ids."""
        max_len, vocab = limits if limits is not None else (None, None)
        default = max_len - len(tokens) if max_len is not None else INT32_MAX
        kwargs = req.sampling_kwargs(default_max_tokens=default)
        check_sampling_values(kwargs)
        for name in ("stop_token_ids", "logit_bias"):
            check_token_ids(kwargs.get(name) or (), vocab, name)
        return kwargs

    # -- dispatch ---------------------------------------------------------------------------
    async def handle(
        self,
        route: str,
        req: CompletionRequest | ChatCompletionRequest,
        prompts: list[list[int]],
        max_tokens: int | None,
        request: Request,
    ) -> Response:
        """Serve on one decode node; a batch goes whole to it, nodes chosen on prompt 0."""
        if req.kv_transfer_params is not None and req.kv_transfer_params.prefill_node:
            raise InvalidRequestError(
                "the router chooses the prefill node; do not send one",
                "kv_transfer_params.prefill_node",
            )
        limits = None
        for ids in prompts:
            limits = self.check_prompt(ids, max_tokens)
        tokens = prompts[0]
        # the KV index lookup goes out now; the rest of the checks run while Redis answers
        salt = self.cache_salt(req, request.scope)  # the KV index is read under it
        first = self.selector.begin(tokens, set(), salt)
        try:
            via_stream = self._via_stream(req, prompts)  # router/buffered.py
            body, path = self._node_body(route, req, prompts, limits, via_stream)
            if salt:
                body["cache_salt"] = salt
            if self.budget.enabled:  # after the checks: a refused request is not charged
                charged = sum(map(len, prompts)) * req.n  # every sequence's prompt
                self.budget.admit(client_key(request.scope), charged)
            rid = self.request_id(request.scope)
        except BaseException:
            if first is not None:
                first.cancel()
            raise
        excluded: set[str] = set()
        last: AttemptFailed | None = None
        for attempt in range(self.config.max_retries + 1):
            if attempt == 0:
                decision = None if first is None else await self.selector.finish(tokens, first)
            else:
                decision = await self.selector.select(tokens, excluded, salt)
            if decision is None:
                break
            if len(prompts) > 1:  # the node's load: every prompt of the batch
                bs = decision.decode.record.block_size
                decision.prompt_blocks = sum(len(p) // bs for p in prompts)
            # off the request's path: runs on the next loop turn, while the node works
            asyncio.get_running_loop().call_soon(self._observe_decision, decision)
            headers = {
                "X-Request-Id": rid,
                "X-Attempt": str(attempt),
                "Content-Type": "application/json",
            }
            if decision.prefill is not None:
                body["kv_transfer_params"] = {"prefill_node": decision.prefill.record.kv_control}
            else:
                body.pop("kv_transfer_params", None)
            content = encode_body(body)
            ctx = None
            if req.stream or via_stream:
                headers[TOKEN_IDS_HEADER] = "1"
                ctx = StreamContext(path, body, prompts, salt, rid, attempt,
                                    req.include_usage or via_stream, req.n, excluded)  # fmt: skip
            logger.info(
                "request %s attempt %d: %d tokens -> decode %s, prefill %s (predicted hit %d)",
                rid, attempt, len(tokens), decision.decode.url,
                decision.prefill.url if decision.prefill else "local",
                decision.predicted_hit_tokens,
            )  # fmt: skip
            try:
                return await self._attempt(decision, path, content, headers, req, route, request,
                                           ctx)  # fmt: skip
            except AttemptFailed as e:
                last = e
                if e.reason == "prefill_rejected":  # the decode node is fine; that pair is not
                    excluded.add(decision.prefill.url)
                else:
                    excluded.add(decision.decode.url)
                    decision.decode.last_error = str(e)
                    if e.node_fault:
                        decision.decode.breaker.record_failure()
                    else:  # the node answered: alive, whatever this request's trouble
                        decision.decode.breaker.record_success()
                logger.warning("request %s attempt %d failed: %s", rid, attempt, e)
                if attempt < self.config.max_retries:
                    self.metrics.retries.labels(reason=e.reason).inc()
        if last is not None and last.body is not None:
            return Response(last.body, status_code=last.status, media_type="application/json")
        if last is not None:
            return error_response(502, str(last), "server_error", code="upstream_error")
        raise NoNodeError("no healthy decode node is available")

    def _via_stream(self, req, prompts: list[list[int]]) -> bool:
        """A non-streamed request the node serves as a stream, so it migrates
        (router/buffered.py)."""
        return not req.stream and self.config.migrate_buffered

    def cache_salt(self, req, scope) -> str:
        """The request's `cache_salt`; with `cache_salt_per_client`, a digest of the client
        (router/token_budget.py `client_key`) and that salt, so clients never share hits."""
        salt = req.cache_salt or ""
        if not self.config.cache_salt_per_client:
            return salt
        h = hashlib.blake2b(client_key(scope), digest_size=16, person=b"pdserve-tenant")
        h.update(b"\0" + salt.encode())
        return h.hexdigest()

    def _node_body(
        self, route: str, req, prompts: list[list[int]], limits, via_stream: bool
    ) -> tuple[dict, str]:
        """The sampling checks, then the body for the node (its prompt as token ids; the
        client's prompt/messages are neither dumped nor walked: a long prompt made both
        cost more than the rest of the request) and the node's path."""
        self.check_sampling(req, max(prompts, key=len), limits)
        prompt_fields = _CHAT_PROMPT if route == "chat" else _COMPLETION_PROMPT
        body = req.model_dump(exclude_unset=True, exclude=prompt_fields)
        _check_finite(body)
        if route == "chat":
            body["prompt_token_ids"] = prompts[0]
        else:
            body["prompt"] = prompts if len(prompts) > 1 else prompts[0]
        if req.stream or via_stream:  # via_stream: a buffered request, asked as a stream
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body, "/v1/chat/completions" if route == "chat" else "/v1/completions"

    def _count_hits(self, answer: bytes) -> None:
        self.metrics.actual_hit_tokens.inc(cached_tokens(answer))

    def _observe_decision(self, d: Decision) -> None:
        m = self.metrics
        m.decision.observe(d.decision_s)
        m.child(m.selections, d.decode.url, d.decode.role).inc()
        if d.prefill is not None:
            m.child(m.selections, d.prefill.url, "prefill").inc()
        m.child(m.prefills, "remote" if d.prefill is not None else "local").inc()
        m.predicted_hit_tokens.inc(d.predicted_hit_tokens)

    async def _attempt(
        self,
        d: Decision,
        path: str,
        body: bytes,
        headers: dict,
        req,
        route: str,
        request: Request,
        ctx: StreamContext | None = None,
    ) -> Response:
        """One attempt. A client that disconnects before the answer (or, streaming, before
        the first token) cancels it, which closes the node connection: the node aborts."""
        node, rid = d.decode, headers["X-Request-Id"]
        watch: ClientWatch | None = request.scope.get(WATCH)
        if watch is not None:  # the lean path: one watcher for the whole request
            guarded = watch.run
        else:

            async def guarded(work):
                return await until_disconnect(request, work)

        node.breaker.on_dispatch()
        node.inflight += 1
        node.inflight_blocks += d.prompt_blocks
        if d.prefill is not None:
            d.prefill.prefill_blocks += d.prompt_blocks
        release = Release(d)
        try:
            if ctx is None:  # a buffered request that does not migrate
                resp = await guarded(send_json(node, path, body, headers))
                if resp is None:
                    return Response(status_code=499)
                node.breaker.record_success()
                if resp.status_code == 200:  # counted after the answer is written
                    asyncio.get_running_loop().call_soon(self._count_hits, resp.content)
                return Response(
                    resp.content,
                    status_code=resp.status_code,
                    media_type="application/json",
                    headers={"X-Request-Id": rid},
                )
            opened = await guarded(open_stream(node, path, body, headers, int(route == "chat")))
            if opened is None:
                return Response(status_code=499)
            node.breaker.record_success()
            release.prefill_done()
            if isinstance(opened, NodeAnswer):  # a 4xx: the client's mistake
                return Response(
                    opened.content, status_code=opened.status_code, media_type="application/json"
                )
            relay = StreamRelay(self, ctx).relay(opened, release)
            events = Relayed(relay, opened, release)
            release = None  # the relay releases from now on, even if never iterated
            if not req.stream:  # buffered: the whole answer, read from the stream
                try:
                    got = await guarded(collect(events, route == "chat"))
                finally:
                    await events.aclose()
                if got is None:
                    return Response(status_code=499)
                return Response(got[1], status_code=got[0], media_type="application/json",
                                headers={"X-Request-Id": rid})  # fmt: skip
            return RelayResponse(
                events, media_type="text/event-stream", headers={"X-Request-Id": rid}
            )
        finally:
            if release is not None:
                release.all()

    def count(self, route: str, status: int) -> None:
        self.metrics.child(self.metrics.requests, route, str(status)).inc()


def _check_finite(body: dict) -> None:
    """NaN and +-Infinity parse from JSON but cannot be relayed: a 400 naming the field."""
    todo: list[tuple[str, object]] = list(body.items())
    while todo:
        name, value = todo.pop()
        if isinstance(value, float) and not math.isfinite(value):
            raise InvalidRequestError(f"{name} must be a finite number, got {value}", name)
        if isinstance(value, dict):
            todo += [(name, v) for v in value.values()]
        elif isinstance(value, list):
            todo += [(name, v) for v in value]
