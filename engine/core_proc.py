"""The EngineCore process: a busy loop `process inputs -> step -> send outputs`.

Three threads, so that the main one only schedules and executes:
- the input thread reads ZMQ frames, decodes them and puts them on `inputs`;
- the main thread drains `inputs` between steps (blocking on it only when the engine has
  no unfinished request), runs `EngineCore.step()` and puts an `OutputBatch` on `outputs`;
- the output thread encodes and sends what lands on `outputs`.
Aborts are therefore honoured between two steps, never in the middle of one.

The process is started with the 'spawn' context and receives only plain data (the frozen
`EngineConfig`, the addresses, a log level and the parent pid). It dies with its parent:
`PR_SET_PDEATHSIG` where Linux offers it, and a watchdog thread polling the parent pid.
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable

import zmq

from pdserve.common.errors import InvalidRequestError
from pdserve.common.parent_death import die_with_parent
from pdserve.engine.config import EngineConfig
from pdserve.engine.core import EngineCore
from pdserve.engine.kv_role import KVRole
from pdserve.engine.kv_store import KVStore
from pdserve.engine.messages import (
    AbortRequests,
    AddRequest,
    CheckIntegrity,
    EngineAddresses,
    EngineDead,
    EngineInput,
    EngineOutput,
    GetCachedHashes,
    GetStats,
    InputCodec,
    OutputBatch,
    OutputCodec,
    Ready,
    Shutdown,
    UtilityResult,
)
from pdserve.engine.outputs import EngineCoreOutput

# Builds the node's PD role and its prefix store (either may be None) from one config.
KVFactory = Callable[[EngineConfig], tuple[KVRole | None, KVStore | None]]

logger = logging.getLogger(__name__)

_WAKE_ADDRESS = "inproc://engine-wake"
_IDLE_SAFETY_POLL_MS = 200  # an idle PD node still steps its role this often
_MAX_BACKOFF_MS = 8  # longest wait between polls while a transfer is pending
# While the engine holds requests but its steps produce nothing (all of them wait on
# something outside, e.g. a prompt's KV), it still sends an empty batch this often: the
# node's progress count (/v1/node `engine.steps`) then shows a live loop, and a router
# takes the node for stuck only when the loop itself stops (a waiting state has its own
# deadline, `kv_transfer.transfer_timeout_s`).
_PROGRESS_EVERY_S = 1.0


def run_engine_core(
    config: EngineConfig,
    addresses: EngineAddresses,
    log_level: int,
    parent_pid: int,
    kv_factory: KVFactory | None = None,
) -> None:
    """Process entry point (target of a spawned `multiprocessing.Process`).

    `kv_factory` builds the node's PD role and prefix store from its config (the node
    package wires engine + role + connectors; the engine itself knows no role). It must be a
    module-level function: the spawned process imports it by name.
    """
    logging.basicConfig(
        level=log_level, format="%(asctime)s %(levelname)s [engine] %(name)s: %(message)s"
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the frontend decides when we stop
    die_with_parent(parent_pid)
    proc = EngineCoreProc(config, addresses, kv_factory)
    # Loaded: a SIGTERM sent to the node's whole process group or cgroup (a launcher's
    # stop, systemd's) now reaches us too, and the node drains its requests before it
    # stops us. (While loading, it still ends us: a node stopped while it starts exits.)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    proc.run()
    # Everything was closed in order in `run`, the NIXL agent included (destroyed by
    # `NixlTransport.close` on this thread), so the interpreter's normal teardown is left
    # with no native object of ours. (Before, the agent was destroyed there, beside other
    # native destructors and daemon threads, and one in ~15 prefill-engine exits on a
    # loaded box died by SIGABRT, "terminate called without an active exception"; an
    # `os._exit(0)` hid it. Not reproduced since: 38 of 38 normal exits were clean on a
    # loaded box, 8 before and 30 after destroying the agent in `close`.)


class EngineCoreProc:
    def __init__(
        self,
        config: EngineConfig,
        addresses: EngineAddresses,
        kv_factory: KVFactory | None = None,
    ):
        self.addresses = addresses
        self.inputs: queue.Queue[EngineInput] = queue.Queue()
        self.outputs: queue.Queue[EngineOutput | None] = queue.Queue()
        self.ctx = zmq.Context()
        # The input thread pings this after queueing an input (wakes an idle PD loop).
        self._wake = self.ctx.socket(zmq.PULL)
        self._wake.bind(_WAKE_ADDRESS)
        self._backoff_ms = 1
        self._last_batch_at = time.monotonic()
        # Start the output thread first so a load failure can still be reported.
        self._out_thread = threading.Thread(target=self._send_outputs, name="engine-output")
        self._out_thread.start()
        try:
            t = time.perf_counter()
            role, store = kv_factory(config) if kv_factory is not None else (None, None)
            self.core = EngineCore(config, role, kv_store=store)
            logger.info("engine loaded %s in %.1f s", self.core.model_dir, time.perf_counter() - t)
        except BaseException as e:
            self._die(f"engine failed to start: {e!r}")
            raise
        threading.Thread(target=self._recv_inputs, name="engine-input", daemon=True).start()
        self.running = True

    # -- main thread ---------------------------------------------------------------------
    def run(self) -> None:
        core = self.core
        self.outputs.put(
            Ready(
                model_dir=str(core.model_dir),
                max_model_len=core.max_model_len,
                vocab_size=core.vocab_size,
                eos_token_ids=sorted(core.eos_token_ids),
                block_size=core.config.cache.block_size,
                num_blocks=core.kv.pool.num_blocks,
                weights_digest=core.weights_digest,
            )
        )
        try:
            while self.running:
                self._process_inputs()
                if self.running and (core.has_unfinished or core.kv_role is not None):
                    self._put_batch(core.step())
        except Exception:
            logger.exception("engine loop crashed")
            self._die(traceback.format_exc(limit=5))
            raise
        if core.kv_role is not None:
            core.kv_role.shutdown()
        if core.kv_store is not None:
            core.kv_store.shutdown()
        self.outputs.put(None)
        self._out_thread.join(timeout=5)
        self._wake.close(linger=0)
        self._term_context()
        logger.info("engine stopped")

    def _term_context(self, timeout_s: float = 5.0) -> None:
        """End the ZMQ context without closing another thread's socket under it.

        `Context.destroy()` closes every socket from this thread, the input thread's too
        while it blocks in `recv`, and libzmq then aborts the process ("Assertion failed:
        _term_acks > 0 (src/own.cpp:153)", or "pfd.revents & POLLIN (src/signaler.cpp:238)").
        `term()` instead makes that `recv` raise ContextTerminated, the input thread closes
        its own sockets, and `term()` returns once every socket is closed.
        """
        t = threading.Thread(target=self.ctx.term, name="zmq-term", daemon=True)
        t.start()
        t.join(timeout_s)
        if t.is_alive():
            logger.warning("ZMQ context still open after %.0f s; exiting anyway", timeout_s)

    def _put_batch(self, outs: list[EngineCoreOutput]) -> None:
        """Queue a step's outputs, with the prefix-cache events it caused (if recorded)."""
        pool = self.core.kv.pool
        events = pool.take_events() if pool.record_events else None
        now = time.monotonic()
        if (
            outs
            or (events is not None and (events.stored or events.evicted or events.store_saved))
            or (self.core.has_unfinished and now - self._last_batch_at >= _PROGRESS_EVERY_S)
        ):
            self._last_batch_at = now
            batch = OutputBatch(outputs=outs, stats=self.core.stats())
            if events is not None:
                batch.kv_stored, batch.kv_evicted = events.stored, events.evicted
                batch.kv_store_saved = events.store_saved
            self.outputs.put(batch)

    def _process_inputs(self) -> None:
        role = self.core.kv_role
        if not self.core.has_unfinished:
            if role is None:
                self._handle(self.inputs.get())  # idle: sleep until something arrives
            else:  # idle PD node: sleep until an input or a peer's control message arrives
                self._wait_for_work(role, timeout_ms=_IDLE_SAFETY_POLL_MS)
        elif self.core.last_step_idle:  # only waiting on something outside (e.g. KV arrival)
            if role is None:
                try:
                    self._handle(self.inputs.get(timeout=0.001))
                except queue.Empty:
                    return
            else:
                # Transfers show up only by polling: back off 1 -> 8 ms while nothing
                # happens, so a waiting node leaves the CPU to a busy one beside it.
                self._wait_for_work(role, timeout_ms=self._backoff_ms)
                self._backoff_ms = min(self._backoff_ms * 2, _MAX_BACKOFF_MS)
        else:
            self._backoff_ms = 1
        while self.running:
            try:
                msg = self.inputs.get_nowait()
            except queue.Empty:
                return
            self._handle(msg)

    def _wait_for_work(self, role, timeout_ms: int) -> None:
        """Block until an input is queued, a role socket is readable, or the timeout passes.

        Event-driven rather than a tight poll, so an idle PD node costs no CPU that a busy
        node beside it on the same cores could use.
        """
        poller = zmq.Poller()
        poller.register(self._wake, zmq.POLLIN)
        for sock in role.wait_sockets():
            poller.register(sock, zmq.POLLIN)
        poller.poll(timeout_ms)
        while self._wake.poll(0):
            self._wake.recv()

    def _handle(self, msg: EngineInput) -> None:
        core = self.core
        if isinstance(msg, AddRequest):
            try:
                core.add_request(
                    msg.request_id, msg.prompt_token_ids, msg.params, msg.remote_prefill
                )
            except Exception as e:  # confined to this request, never the engine loop
                if isinstance(e, InvalidRequestError):
                    logger.warning("request %s rejected: %s", msg.request_id, e)
                else:
                    logger.exception("request %s could not be added", msg.request_id)
                err = EngineCoreOutput(
                    request_id=msg.request_id, new_token_ids=[], finish_reason="error", error=str(e)
                )
                self.outputs.put(OutputBatch(outputs=[err], stats=core.stats()))
        elif isinstance(msg, AbortRequests):
            outs = core.abort_requests(msg.request_ids)
            if outs:
                logger.info("aborted %s", ", ".join(o.request_id for o in outs))
            self._put_batch(outs)
        elif isinstance(msg, GetStats):
            self.outputs.put(UtilityResult(call_id=msg.call_id, stats=core.stats()))
        elif isinstance(msg, CheckIntegrity):
            error = None
            try:
                core.check_integrity()
            except Exception as e:  # BlockPoolError, or a KV role's own invariant
                error = f"{type(e).__name__}: {e}"
            self.outputs.put(
                UtilityResult(
                    call_id=msg.call_id,
                    stats=core.stats(),
                    error=error,
                    requests=core.scheduler.describe(core.grammars.requests()),
                )
            )
        elif isinstance(msg, GetCachedHashes):
            hashes = core.kv.pool.cached_hashes()
            self.outputs.put(
                UtilityResult(call_id=msg.call_id, stats=core.stats(), cached_hashes=hashes)
            )
        elif isinstance(msg, Shutdown):
            logger.info("shutdown requested")
            self.running = False

    def _die(self, error: str) -> None:
        self.outputs.put(EngineDead(error=error))
        self.outputs.put(None)
        self._out_thread.join(timeout=5)

    # -- I/O threads ---------------------------------------------------------------------
    def _recv_inputs(self) -> None:
        sock = self.ctx.socket(zmq.PULL)
        sock.connect(self.addresses.input)
        wake = self.ctx.socket(zmq.PUSH)
        wake.setsockopt(zmq.SNDHWM, 1)  # one pending ping is enough
        wake.connect(_WAKE_ADDRESS)
        codec = InputCodec()
        try:
            while True:
                frame = sock.recv(copy=False)
                try:
                    self.inputs.put(codec.decode(frame.buffer))
                except Exception:
                    logger.exception("dropping an undecodable input frame")
                    continue
                try:
                    wake.send(b"", zmq.NOBLOCK)
                except zmq.Again:
                    pass  # a ping is already pending
        except zmq.ContextTerminated:
            pass
        finally:
            sock.close(linger=0)
            wake.close(linger=0)

    def _send_outputs(self) -> None:
        sock = self.ctx.socket(zmq.PUSH)
        sock.connect(self.addresses.output)
        codec = OutputCodec()
        try:
            while (msg := self.outputs.get()) is not None:
                sock.send(codec.encode(msg), copy=False)
        finally:
            sock.close(linger=1000)
