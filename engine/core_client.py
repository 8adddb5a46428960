"""The frontend's handle on its EngineCore process: start it, talk to it over ZMQ.

`EngineCoreClient.start()` binds both channels, spawns the engine process and waits for its
`Ready`. Afterwards one output-handler task receives every `OutputBatch` and routes each
`EngineCoreOutput` to the asyncio queue of its request (with the time it arrived); it also
answers utility calls by `call_id`. If the engine process dies, every open request gets a
terminal error output and `dead` becomes the reason.

Contract: `add_request` returns the request's queue; the queue ends with an output whose
`finish_reason` is set. `abort_requests` never blocks and may be called from `finally`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import time
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio

from pdserve.common.errors import InvalidRequestError
from pdserve.engine.config import EngineConfig
from pdserve.engine.core_proc import KVFactory, run_engine_core
from pdserve.engine.messages import (
    AbortRequests,
    AddRequest,
    CheckIntegrity,
    EngineAddresses,
    EngineDead,
    EngineInput,
    GetCachedHashes,
    GetStats,
    InputCodec,
    OutputBatch,
    OutputCodec,
    Ready,
    RequestState,
    Shutdown,
    UtilityResult,
)
from pdserve.engine.outputs import EngineCoreOutput, EngineStats
from pdserve.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# What a request's queue carries: (arrival time at the frontend, output).
TimedOutput = tuple[float, EngineCoreOutput]


class EngineDeadError(RuntimeError):
    """The engine process is gone; no request can be served."""


class EngineCoreClient:
    def __init__(
        self,
        config: EngineConfig,
        addresses: EngineAddresses,
        kv_factory: KVFactory | None = None,
    ):
        self.config = config
        self.addresses = addresses
        self.kv_factory = kv_factory
        self.info: Ready | None = None
        self.dead: str | None = None
        self.latest_stats: EngineStats | None = None
        self.num_batches = 0  # output batches received: the engine loop's visible progress
        self.on_batch: Callable[[OutputBatch], None] | None = None  # e.g. metrics
        self._queues: dict[str, asyncio.Queue[TimedOutput]] = {}
        self._calls: dict[int, asyncio.Future[UtilityResult]] = {}
        self._call_ids = itertools.count()
        self._in_codec = InputCodec()
        self._out_codec = OutputCodec()
        self._ctx = zmq.asyncio.Context()
        self._tasks: list[asyncio.Task] = []
        self.proc: multiprocessing.process.BaseProcess | None = None

    # -- lifecycle -----------------------------------------------------------------------
    async def start(self, ready_timeout_s: float = 600.0) -> Ready:
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.bind(self.addresses.input)
        self._output = self._ctx.socket(zmq.PULL)
        self._output.bind(self.addresses.output)
        mp = multiprocessing.get_context("spawn")
        self.proc = mp.Process(
            target=run_engine_core,
            args=(
                self.config,
                self.addresses,
                logging.getLogger().getEffectiveLevel(),
                os.getpid(),
                self.kv_factory,
            ),
            name="EngineCore",
            daemon=True,
        )
        self.proc.start()
        logger.info("engine process %d starting (%s)", self.proc.pid, self.config.model.name)
        self.info = await self._wait_ready(ready_timeout_s)
        self._tasks = [
            asyncio.create_task(self._handle_outputs(), name="engine-outputs"),
            asyncio.create_task(self._watch_process(), name="engine-watch"),
        ]
        return self.info

    async def _wait_ready(self, timeout_s: float) -> Ready:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if await self._output.poll(500):
                msg = self._out_codec.decode(await self._output.recv())
                if isinstance(msg, Ready):
                    logger.info("engine ready: max_model_len=%d", msg.max_model_len)
                    return msg
                if isinstance(msg, EngineDead):
                    raise EngineDeadError(msg.error)
            elif not self.proc.is_alive():
                raise EngineDeadError(f"engine process exited with code {self.proc.exitcode}")
        raise EngineDeadError(f"engine not ready after {timeout_s:.0f} s")

    async def shutdown(self, timeout_s: float = 5.0) -> None:
        for t in self._tasks:
            t.cancel()
        if self.proc is not None and self.proc.is_alive():
            self._send(Shutdown())
            await asyncio.to_thread(self.proc.join, timeout_s)
            if self.proc.is_alive():  # it ignores SIGTERM (engine/core_proc.py)
                logger.warning("engine did not stop in %.0f s; killing it", timeout_s)
                self.proc.kill()
                await asyncio.to_thread(self.proc.join, 2.0)
        self._ctx.destroy(linger=0)
        logger.info("engine process stopped")

    # -- requests ------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        remote_prefill: str | None = None,
    ) -> asyncio.Queue[TimedOutput]:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        msg = AddRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            params=params,
            remote_prefill=remote_prefill,
        )
        try:  # encode before registering: a value the wire cannot carry leaks nothing
            frame = self._in_codec.encode(msg)
        except (OverflowError, TypeError, msgspec.EncodeError) as e:
            raise InvalidRequestError(f"request cannot be encoded: {e}") from e
        q: asyncio.Queue[TimedOutput] = asyncio.Queue()
        self._queues[request_id] = q
        self._input.send(frame, copy=False)
        return q

    @property
    def open_request_ids(self) -> list[str]:
        """Requests given to the engine whose outputs this process still waits for."""
        return list(self._queues)

    @property
    def num_open(self) -> int:
        """Requests given to the engine and not yet finished: the work it holds."""
        return len(self._queues)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Forget these requests here and end them in the engine (frees their blocks)."""
        for rid in request_ids:
            self._queues.pop(rid, None)
        if request_ids and self.dead is None:
            self._send(AbortRequests(request_ids=request_ids))

    async def get_stats(self) -> EngineStats:
        result = await self._call(GetStats(call_id=next(self._call_ids)))
        assert result.stats is not None
        return result.stats

    async def check_integrity(self) -> str | None:
        """None when the engine's KV invariants hold, else the violation."""
        return (await self.debug_state())[0]

    async def debug_state(self) -> tuple[str | None, list[RequestState]]:
        """(the violated KV invariant or None, every unfinished request of the engine)."""
        result = await self._call(CheckIntegrity(call_id=next(self._call_ids)))
        return result.error, result.requests or []

    async def get_cached_hashes(self) -> list[bytes]:
        """Every block hash in the engine's prefix cache now."""
        result = await self._call(GetCachedHashes(call_id=next(self._call_ids)))
        return result.cached_hashes or []

    async def _call(
        self, msg: GetStats | CheckIntegrity | GetCachedHashes, timeout_s: float = 30.0
    ) -> UtilityResult:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        fut: asyncio.Future[UtilityResult] = asyncio.get_running_loop().create_future()
        self._calls[msg.call_id] = fut
        self._send(msg)
        try:
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self._calls.pop(msg.call_id, None)

    def _send(self, msg: EngineInput) -> None:
        # PUSH to a connected peer completes at once; zmq.asyncio keeps order otherwise.
        self._input.send(self._in_codec.encode(msg), copy=False)

    # -- background tasks ----------------------------------------------------------------
    async def _handle_outputs(self) -> None:
        while True:
            msg = self._out_codec.decode(await self._output.recv(copy=False))
            now = time.monotonic()
            if isinstance(msg, OutputBatch):
                self.latest_stats = msg.stats
                self.num_batches += 1
                for out in msg.outputs:
                    q = self._queues.get(out.request_id)
                    if q is None:
                        continue  # aborted here already
                    q.put_nowait((now, out))
                    if out.finished:
                        del self._queues[out.request_id]
                if self.on_batch is not None:
                    self.on_batch(msg)
            elif isinstance(msg, UtilityResult):
                fut = self._calls.get(msg.call_id)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            elif isinstance(msg, EngineDead):
                self._fail_all(f"engine crashed: {msg.error}")
                return

    async def _watch_process(self) -> None:
        while self.proc.is_alive():
            await asyncio.sleep(0.5)
        self._fail_all(f"engine process exited with code {self.proc.exitcode}")

    def _fail_all(self, reason: str) -> None:
        if self.dead is None:
            logger.error("%s; failing %d open requests", reason, len(self._queues))
        self.dead = reason
        now = time.monotonic()
        for rid, q in self._queues.items():
            q.put_nowait(
                (
                    now,
                    EngineCoreOutput(
                        request_id=rid, new_token_ids=[], finish_reason="error", error=reason
                    ),
                )
            )
        self._queues.clear()
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(reason))
