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
from pathlib import Path

from pdserve.common.errors import InvalidRequestError
from pdserve.common.model_files import existing_model_dir
from pdserve.common.sampling_rules import check_token_ids
from pdserve.engine.config import EngineConfig
from pdserve.engine.core_client import EngineCoreClient
from pdserve.engine.core_proc import KVFactory
from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.messages import EngineAddresses, Ready
from pdserve.engine.outputs import OutputStream, RequestDelta
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


class RequestFailedError(RuntimeError):
    """The engine ended a request with an error (or died) after it was accepted."""


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
        # The tokenizer (~3 s, most of it importing transformers) loads while the engine
        # process starts, from the model directory where it is known before the engine
        # says (a converted model; a first conversion happens in the engine).
        early_dir = existing_model_dir(self.config.model.name)
        early = None
        if early_dir is not None:
            early = asyncio.create_task(asyncio.to_thread(load_tokenizer, early_dir))
        try:
            self.info = await self.client.start()
        except BaseException:
            if early is not None:
                early.add_done_callback(lambda t: t.cancelled() or t.exception())
                early.cancel()
            raise
        if early is not None and Path(self.info.model_dir) == early_dir:
            self.tokenizer = await early
        else:
            if early is not None:  # not the engine's directory: its outcome is dropped
                early.add_done_callback(lambda t: t.cancelled() or t.exception())
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
        resumed: tuple[list[int], int] | None = None,
    ) -> AsyncIterator[RequestDelta]:
        """Stream the request's deltas; the last one has `finish_reason` set.

        `remote_prefill` (decode role) names the prefill node that computes the prompt's KV.
        `resumed` (a migrated request's continuation, node/resume.py): the output tokens
        already streamed and the characters of their text the client has; the text goes
        on from there (a character split across the boundary, a stop string spanning it).
        Raises `RequestFailedError` if the engine fails the request.
        """
        queue = self.client.add_request(request_id, prompt_token_ids, params, remote_prefill)
        detok = IncrementalDetokenizer(self.tokenizer, params.stop) if self.tokenizer else None
        if detok is not None and resumed is not None:
            detok.resume(*resumed)
        stream = OutputStream(detok, params.logprobs)
        last_token_time: float | None = None
        finished = False
        try:
            while not finished:
                items = [await queue.get()]
                while not queue.empty():  # a slow consumer gets merged deltas
                    items.append(queue.get_nowait())
                ttft_s, itl_s = None, []
                for t, out in items:
                    if out.error is not None:
                        raise RequestFailedError(out.error)
                    if out.new_token_ids:
                        if last_token_time is None:
                            ttft_s = t - arrival
                        else:
                            itl_s.append(t - last_token_time)
                        last_token_time = t
                    stream.add(out)
                delta = stream.take()
                delta.ttft_s, delta.itl_s = ttft_s, itl_s
                finished = delta.finish_reason is not None
                if stream.stopped_early:  # a stop string ended it before the engine did
                    self.client.abort_requests([request_id])
                yield delta
        finally:
            if not finished:
                logger.info("request %s cancelled by its client; aborting it", request_id)
                self.client.abort_requests([request_id])

    async def get_stats(self):
        return await self.client.get_stats()

    async def check_integrity(self) -> str | None:
        return await self.client.check_integrity()
