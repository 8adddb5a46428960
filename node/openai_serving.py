"""The two generation endpoints: /v1/completions and /v1/chat/completions.

Each turns an OpenAI request into token ids and `SamplingParams`, checks it against the
model (context length, vocabulary) before anything is sent to the engine, then either
streams SSE chunks (`data: {...}` ... `data: [DONE]`) or collects one JSON response.
Streamed and collected text come from the same incremental detokenizer, so they are equal.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field

from api.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatLogprobToken,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
    PromptTokensDetails,
    UsageInfo,
)
from engine.async_llm import AsyncLLM, RequestDelta, RequestFailedError
from engine.config import KVTransferConfig
from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from engine.tokenizer import apply_chat_template
from node.metrics import NodeMetrics
from node.prefill_nodes import PrefillNodes

logger = logging.getLogger(__name__)


class ModelNotFoundError(LookupError):
    def __init__(self, model: str):
        super().__init__(f"the model {model!r} does not exist on this node")
        self.model = model


@dataclass
class Generation:
    """Everything one request produced, accumulated from its deltas."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0

    def add(self, delta: RequestDelta) -> None:
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs
        self.finish_reason = delta.finish_reason
        self.num_prompt_tokens = delta.num_prompt_tokens
        self.num_cached_tokens = delta.num_cached_tokens

    def usage(self) -> UsageInfo:
        n = len(self.token_ids)
        return UsageInfo(
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=n,
            total_tokens=self.num_prompt_tokens + n,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self.num_cached_tokens),
        )


@dataclass
class Prepared:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float
    remote_prefill: str | None = None  # PD: the prefill node's control address


class OpenAIServing:
    def __init__(
        self,
        llm: AsyncLLM,
        metrics: NodeMetrics,
        model_name: str,
        pd: KVTransferConfig | None = None,
        prefill_nodes: PrefillNodes | None = None,
    ):
        """`prefill_nodes` (decode role): the allowed prefill nodes; by default the
        configured ones. A cluster registry passes `PrefillNodes(its_callable)`."""
        self.llm = llm
        self.metrics = metrics
        self.model_name = model_name
        self.pd = pd or KVTransferConfig()
        self.prefill_nodes = prefill_nodes or PrefillNodes.configured(
            self.pd.prefill_nodes, self.pd.role
        )

    # -- request preparation ------------------------------------------------------------
    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ModelNotFoundError(model)

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        if self.llm.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: send token ids", "prompt")
        return self.llm.tokenizer.encode(prompt, add_special_tokens=False)

    def prepare_completion(self, req: CompletionRequest) -> Prepared:
        arrival = time.monotonic()
        self._check_model(req.model)
        ids = self._encode(req.single_prompt())
        return self._prepare("cmpl", ids, req, req.max_tokens, arrival)

    def prepare_chat(self, req: ChatCompletionRequest) -> Prepared:
        arrival = time.monotonic()
        self._check_model(req.model)
        if req.prompt_token_ids is not None:
            ids = req.prompt_token_ids
        elif not req.messages:
            raise InvalidRequestError("messages must not be empty", "messages")
        else:
            if self.llm.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: chat needs one", "messages")
            try:
                ids = apply_chat_template(
                    self.llm.tokenizer, [m.to_template_dict() for m in req.messages]
                )
            except Exception as e:  # the template itself may reject a conversation
                raise InvalidRequestError(
                    f"the chat template rejected the messages: {e}", "messages"
                ) from e
        return self._prepare("chatcmpl", ids, req, req.requested_max_tokens, arrival)

    def _prepare(
        self, kind: str, ids: list[int], req, max_tokens: int | None, arrival: float
    ) -> Prepared:
        self.llm.validate_prompt(ids, max_tokens)
        params = SamplingParams(
            **req.sampling_kwargs(default_max_tokens=self.llm.max_model_len - len(ids))
        )
        rid = f"{kind}-{uuid.uuid4().hex}"
        prefill_node = self._prefill_node(req)
        logger.info(
            "request %s: %d prompt tokens, max_tokens=%d, temperature=%s, stream=%s%s",
            rid,
            len(ids),
            params.max_tokens,
            params.temperature,
            req.stream,
            f", prefill on {prefill_node}" if prefill_node else "",
        )
        return Prepared(rid, ids, params, arrival, prefill_node)

    def _prefill_node(self, req) -> str | None:
        """The prefill node for a PD request: the router's choice if allowed, else in turn."""
        asked = req.kv_transfer_params.prefill_node if req.kv_transfer_params else None
        return self.prefill_nodes.choose(asked)

    # -- generation ---------------------------------------------------------------------
    async def _deltas(self, p: Prepared) -> AsyncIterator[RequestDelta]:
        """The request's deltas, with metrics observed along the way."""
        async with aclosing(
            self.llm.generate(
                p.request_id, p.prompt_token_ids, p.params, p.arrival, p.remote_prefill
            )
        ) as gen:
            async for delta in gen:
                self.metrics.observe_tokens(delta.ttft_s, delta.itl_s)
                if delta.finish_reason is not None:
                    self.metrics.observe_finished(
                        delta.finish_reason, len(p.prompt_token_ids), time.monotonic() - p.arrival
                    )
                    logger.info(
                        "request %s finished (%s): %d tokens",
                        p.request_id,
                        delta.finish_reason,
                        delta.num_output_tokens,
                    )
                yield delta

    async def collect(self, p: Prepared) -> Generation:
        gen = Generation()
        async with aclosing(self._deltas(p)) as deltas:
            async for delta in deltas:
                gen.add(delta)
        return gen

    def completion_response(self, p: Prepared, g: Generation) -> CompletionResponse:
        return CompletionResponse(
            id=p.request_id,
            model=self.model_name,
            choices=[
                CompletionChoice(
                    text=g.text,
                    logprobs=self._completion_logprobs(g.token_ids, g.logprobs, 0),
                    finish_reason=g.finish_reason,
                )
            ],
            usage=g.usage(),
        )

    def chat_response(self, p: Prepared, g: Generation) -> ChatCompletionResponse:
        return ChatCompletionResponse(
            id=p.request_id,
            model=self.model_name,
            choices=[
                ChatChoice(
                    message=AssistantMessage(content=g.text),
                    logprobs=self._chat_logprobs(g.token_ids, g.logprobs),
                    finish_reason=g.finish_reason,
                )
            ],
            usage=g.usage(),
        )

    # -- streaming ----------------------------------------------------------------------
    async def stream_completion(self, p: Prepared, include_usage: bool) -> AsyncIterator[str]:
        offset = 0

        def chunk(delta: RequestDelta) -> str:
            nonlocal offset
            lp = self._completion_logprobs(delta.token_ids, delta.logprobs, offset)
            offset += len(delta.text)
            return CompletionResponse(
                id=p.request_id,
                model=self.model_name,
                choices=[
                    CompletionChoice(
                        text=delta.text, logprobs=lp, finish_reason=delta.finish_reason
                    )
                ],
            ).model_dump_json()

        def usage_chunk(g: Generation) -> str:
            return CompletionResponse(
                id=p.request_id, model=self.model_name, choices=[], usage=g.usage()
            ).model_dump_json()

        async for event in self._sse(p, include_usage, chunk, usage_chunk, first=None):
            yield event

    async def stream_chat(self, p: Prepared, include_usage: bool) -> AsyncIterator[str]:
        def chunk(delta: RequestDelta) -> str:
            return ChatCompletionChunk(
                id=p.request_id,
                model=self.model_name,
                choices=[
                    ChatChunkChoice(
                        delta=DeltaMessage(content=delta.text),
                        logprobs=self._chat_logprobs(delta.token_ids, delta.logprobs),
                        finish_reason=delta.finish_reason,
                    )
                ],
            ).model_dump_json()

        def usage_chunk(g: Generation) -> str:
            return ChatCompletionChunk(
                id=p.request_id, model=self.model_name, choices=[], usage=g.usage()
            ).model_dump_json()

        first = ChatCompletionChunk(
            id=p.request_id,
            model=self.model_name,
            choices=[ChatChunkChoice(delta=DeltaMessage(role="assistant", content=""))],
        ).model_dump_json()
        async for event in self._sse(p, include_usage, chunk, usage_chunk, first=first):
            yield event

    async def _sse(
        self,
        p: Prepared,
        include_usage: bool,
        chunk: Callable[[RequestDelta], str],
        usage_chunk: Callable[[Generation], str],
        first: str | None,
    ) -> AsyncIterator[str]:
        if first is not None:
            yield f"data: {first}\n\n"
        g = Generation()
        try:
            async with aclosing(self._deltas(p)) as deltas:
                async for delta in deltas:
                    g.add(delta)
                    if delta.text or delta.finish_reason is not None or delta.logprobs:
                        yield f"data: {chunk(delta)}\n\n"
        except RequestFailedError as e:
            logger.error("request %s failed: %s", p.request_id, e)
            err = ErrorResponse(
                error=ErrorInfo(message=str(e), type="server_error", code="engine_error")
            )
            yield f"data: {err.model_dump_json()}\n\n"
        else:
            if include_usage:
                yield f"data: {usage_chunk(g)}\n\n"
        yield "data: [DONE]\n\n"

    # -- logprobs -----------------------------------------------------------------------
    def _token_strings(self, token_ids: list[int]) -> list[str]:
        tok = self.llm.tokenizer
        if tok is None:
            return [f"token_id:{t}" for t in token_ids]
        return [tok.decode([t]) for t in token_ids]

    def _completion_logprobs(
        self, token_ids: list[int], logprobs: list[float] | None, offset: int
    ) -> CompletionLogprobs | None:
        if logprobs is None:
            return None
        tokens = self._token_strings(token_ids)
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return CompletionLogprobs(tokens=tokens, token_logprobs=logprobs, text_offset=offsets)

    def _chat_logprobs(
        self, token_ids: list[int], logprobs: list[float] | None
    ) -> ChatLogprobs | None:
        if logprobs is None:
            return None
        return ChatLogprobs(
            content=[
                ChatLogprobToken(token=t, logprob=lp, bytes=list(t.encode()))
                for t, lp in zip(self._token_strings(token_ids), logprobs, strict=True)
            ]
        )
