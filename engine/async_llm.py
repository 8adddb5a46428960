"""The node's frontend engine: submit a request, iterate over its output as it streams.

`AsyncLLM` owns the `EngineCoreClient` (which owns the engine process) and the tokenizer.
`generate()` yields one `RequestDelta` per batch of tokens received: new token ids, the text
they add (incremental detokenization, stop strings applied) and, with the last one, the
finish reason. Leaving the iteration early (the caller is cancelled, e.g. its HTTP client
disconnected, or it stops iterating) aborts the request in the engine, freeing its blocks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pdserve.common.errors import InvalidRequestError
from pdserve.common.sampling_rules import check_token_ids
from pdserve.engine.config import EngineConfig
from pdserve.engine.core_client import EngineCoreClient
from pdserve.engine.core_proc import KVFactory
from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.messages import EngineAddresses, Ready
from pdserve.engine.outputs import RequestTimings, TokenLogprobs
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


class RequestFailedError(RuntimeError):
    """The engine ended a request with an error (or died) after it was accepted."""


@dataclass(slots=True)
class RequestDelta:
    """What one request produced since its previous delta."""

    token_ids: list[int]
    text: str
    logprobs: list[float] | None = None
    top_logprobs: list[TokenLogprobs] | None = None  # per token, when top_logprobs > 0
    prompt_logprobs: list[TokenLogprobs] | None = None  # once: prompt tokens 1..
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # cumulative
    num_cached_tokens: int = 0
    ttft_s: float | None = None  # set on the delta carrying the first token
    itl_s: list[float] = field(default_factory=list)  # gaps between later token arrivals
    timings: RequestTimings | None = None  # engine-side TTFT stages, with the first token


class AsyncLLM:
    def __init__(
        self,
        config: EngineConfig,
        addresses: EngineAddresses,
        kv_factory: KVFactory | None = None,
    ):
        self.config = config
        self.client = EngineCoreClient(config, addresses, kv_factory)
        self.tokenizer = None
        self.info: Ready | None = None

    async def start(self) -> None:
        self.info = await self.client.start()
        self.tokenizer = await asyncio.to_thread(load_tokenizer, self.info.model_dir)

    async def shutdown(self) -> None:
        await self.client.shutdown()

    @property
    def max_model_len(self) -> int:
        assert self.info is not None
        return self.info.max_model_len

    def validate_prompt(self, prompt_token_ids: list[int], max_tokens: int | None) -> None:
        """Reject what the engine would reject, before anything is streamed."""
        assert self.info is not None
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("the prompt is empty", "prompt")
        if n >= self.info.max_model_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.info.max_model_len} tokens; "
                f"the prompt has {n} tokens (it must leave room for at least one new token)",
                "prompt",
            )
        if max_tokens is not None and n + max_tokens > self.info.max_model_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.info.max_model_len} tokens; "
                f"the prompt has {n} tokens and max_tokens asks for {max_tokens} more",
                "max_tokens",
            )
        check_token_ids(prompt_token_ids, self.info.vocab_size, "prompt")

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival: float,
        remote_prefill: str | None = None,
    ) -> AsyncIterator[RequestDelta]:
        """Stream the request's deltas; the last one has `finish_reason` set.

        `remote_prefill` (decode role) names the prefill node that computes the prompt's KV.
        Raises `RequestFailedError` if the engine fails the request.
        """
        queue = self.client.add_request(request_id, prompt_token_ids, params, remote_prefill)
        detok = IncrementalDetokenizer(self.tokenizer, params.stop) if self.tokenizer else None
        num_output = 0
        last_token_time: float | None = None
        finished = False
        try:
            while not finished:
                items = [await queue.get()]
                while not queue.empty():  # a slow consumer gets merged deltas
                    items.append(queue.get_nowait())
                delta = RequestDelta(
                    token_ids=[], text="", logprobs=[] if params.logprobs else None
                )
                for t, out in items:
                    if out.error is not None:
                        raise RequestFailedError(out.error)
                    if out.new_token_ids:
                        if last_token_time is None:
                            delta.ttft_s = t - arrival
                        else:
                            delta.itl_s.append(t - last_token_time)
                        last_token_time = t
                    delta.token_ids.extend(out.new_token_ids)
                    if out.timings is not None:
                        delta.timings = out.timings
                    if delta.logprobs is not None and out.new_logprobs:
                        delta.logprobs.extend(out.new_logprobs)
                    if out.new_top_logprobs:
                        delta.top_logprobs = (delta.top_logprobs or []) + out.new_top_logprobs
                    if out.prompt_logprobs is not None:
                        delta.prompt_logprobs = out.prompt_logprobs
                    delta.num_prompt_tokens = out.num_prompt_tokens
                    delta.num_cached_tokens = out.num_cached_tokens
                    delta.finish_reason = out.finish_reason
                finished = delta.finish_reason is not None
                num_output += len(delta.token_ids)
                delta.num_output_tokens = num_output
                if detok is not None:
                    delta.text = detok.update(delta.token_ids, final=finished)
                    if detok.stopped:
                        if not finished:
                            self.client.abort_requests([request_id])
                        delta.finish_reason = "stop"
                        finished = True
                yield delta
        finally:
            if not finished:
                logger.info("request %s cancelled by its client; aborting it", request_id)
                self.client.abort_requests([request_id])

    async def get_stats(self):
        return await self.client.get_stats()

    async def check_integrity(self) -> str | None:
        return await self.client.check_integrity()
