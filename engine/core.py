"""EngineCore: the schedule -> execute -> update loop of one node, without I/O."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pdserve.common.block_hash import root_hash
from pdserve.common.errors import ConfigError, InvalidRequestError
from pdserve.common.model_files import resolve_model
from pdserve.common.sampling_rules import check_token_ids
from pdserve.common.weights_digest import weights_digest
from pdserve.engine.config import EngineConfig
from pdserve.engine.cpu_heap import keep_freed_memory
from pdserve.engine.grammar import GrammarCompiler
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.kv_role import KVRole
from pdserve.engine.kv_store import KVStore
from pdserve.engine.model_arch import ModelArch
from pdserve.engine.model_build import kv_bytes_per_block
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.outputs import EngineCoreOutput, EngineStats, RequestTimings, TokenLogprobs
from pdserve.engine.pending_grammars import PendingGrammars
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampler import Unsatisfiable
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.store_driver import StoreDriver

logger = logging.getLogger(__name__)

# (config, arch, model_dir, num_blocks) -> an object with ModelRunner's `kv_cache` and `execute`
RunnerFactory = Callable[[EngineConfig, ModelArch, str, int], ModelRunner]


def eos_token_ids(model_dir: str | Path, arch: ModelArch) -> frozenset[int]:
    ids: set[int] = set()
    for source in (arch.eos_token_id, _generation_eos(model_dir)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    return frozenset(ids)


def _generation_eos(model_dir: str | Path):
    path = Path(model_dir) / "generation_config.json"
    if not path.exists():
        return None
    return json.loads(path.read_text()).get("eos_token_id")


class EngineCore:
    """One model, one KV pool, one scheduler. Not thread-safe: drive it from one thread.

    `add_request` validates and queues; `step` runs one batch and returns what each
    request produced; `abort_requests` ends requests and frees their blocks at once.
    """

    def __init__(
        self,
        config: EngineConfig,
        kv_role: KVRole | None = None,
        *,
        arch: ModelArch | None = None,
        runner_factory: RunnerFactory | None = None,
        kv_store: KVStore | None = None,
    ):
        """`arch` + `runner_factory` replace the model files and `ModelRunner` (a stub
        runner for protocol simulations); by default both come from `config.model`.
        `kv_store`: a shared prefix store (engine/kv_store.py)."""
        self.config = config
        self.kv_role = kv_role
        self.kv_store = kv_store
        torch.set_num_threads(config.threads)
        if config.model.device.startswith("cpu") and config.model.cpu_keep_freed_memory:
            keep_freed_memory()
        if arch is None:
            self.model_dir = resolve_model(config.model.name)
            arch = ModelArch.from_dir(self.model_dir)
            # KV belongs to these weights: the block-hash root is keyed by their digest
            self.weights_digest = weights_digest(self.model_dir)
        else:
            self.model_dir = Path(config.model.name)
            self.weights_digest = ""
        self.arch = arch
        cc = config.cache
        per_block = kv_bytes_per_block(arch, cc.block_size, config.model.torch_dtype)
        num_blocks = cc.num_blocks or cc.kv_cache_bytes // per_block
        if num_blocks < 1:
            raise ConfigError(
                "cache.kv_cache_bytes", f"{cc.kv_cache_bytes} bytes hold no block of {per_block}"
            )
        model_max = config.model.max_model_len or arch.max_position_embeddings
        if model_max > arch.max_position_embeddings:
            raise ConfigError(
                "model.max_model_len",
                f"{model_max} exceeds the model's context {arch.max_position_embeddings}",
            )
        # A sequence can never grow beyond what the whole pool holds.
        self.max_model_len = min(model_max, num_blocks * cc.block_size)
        self.vocab_size = arch.vocab_size
        self.eos_token_ids = eos_token_ids(self.model_dir, arch)
        self.hash_root = self.root_for("")
        self.kv = KVCacheManager(num_blocks, cc.block_size, cc.enable_prefix_caching)
        self.kv.pool.record_events = cc.kv_events
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len)
        if runner_factory is None and config.tensor_parallel_size > 1:
            from pdserve.engine.tp_runner import TPRunner, refuse_unsupported

            refuse_unsupported(config)
            runner_factory = TPRunner
        self.runner = (runner_factory or ModelRunner)(config, arch, str(self.model_dir), num_blocks)
        self.requests: dict[str, Request] = {}
        self.grammars = PendingGrammars(
            GrammarCompiler(str(self.model_dir), self.vocab_size, sorted(self.eos_token_ids))
        )
        self.generated_tokens = 0
        self.prefill_paths: dict[str, int] = {}  # requests by `RequestTimings.prefill`
        self.num_steps = 0  # engine loop progress (EngineStats.engine_steps)
        self.last_step_idle = True
        if kv_role is not None:
            kv_role.attach(self)
        self.store = None  # drives kv_store from the loop (engine/store_driver.py)
        if kv_store is not None:
            kv_store.attach(self.runner.kv_cache)
            bs, chunk = cc.block_size, config.kv_store.chunk_size
            self.store = StoreDriver(kv_store, self.kv, self.scheduler, bs, chunk)
            # Only a store that can load makes a prompt wait for one (a save-only one never).
            self.scheduler.store_loads_enabled = getattr(kv_store, "can_load", True)

    # -- requests --------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not prompt_token_ids:
            raise InvalidRequestError("prompt is empty", "prompt")
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(prompt_token_ids)} tokens; this model's context is "
                f"{self.max_model_len} (the prompt must leave room for one new token)",
                "prompt",
            )
        for field, ids in (
            ("prompt", prompt_token_ids),
            ("stop_token_ids", params.stop_token_ids),
            ("logit_bias", list(params.logit_bias)),
        ):
            check_token_ids(ids, self.vocab_size, field)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        remote_prefill: str | None = None,
    ) -> Request:
        """Queue a request. `remote_prefill` names the prefill node (decode role only)."""
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already running", "request_id")
        self.validate(prompt_token_ids, params)
        if remote_prefill is not None and not (
            self.kv_role is not None and self.kv_role.accepts_remote_prefill
        ):
            raise InvalidRequestError(
                "this node cannot take remote-prefill requests", "kv_transfer_params"
            )
        req = Request(
            request_id,
            prompt_token_ids,
            params,
            self.config.cache.block_size,
            self.eos_token_ids,
            remote_prefill=remote_prefill,
            hash_root=self.root_for(params.cache_salt) if params.cache_salt else self.hash_root,
        )
        # A grammar compiles off this thread: the request is scheduled once it is ready.
        ready = params.grammar is None or self.grammars.start(req, params.grammar)
        self.requests[request_id] = req
        if ready:
            self.scheduler.add_request(req)
        return req

    def root_for(self, salt: str) -> bytes:
        """The block-hash root of this model's weights for a request's cache salt."""
        cfg = self.config
        return root_hash(cfg.model.api_name, cfg.cache.block_size, salt, self.weights_digest)

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        outs = []
        for rid in request_ids:
            out = self.end_request(rid, RequestStatus.FINISHED_ABORTED)
            if out is not None:
                outs.append(out)
        return outs

    def end_request(
        self, request_id: str, status: RequestStatus, error: str | None = None
    ) -> EngineCoreOutput | None:
        """End a request now (abort, or an error confined to it); its final output, if any.

        Blocks a transfer may still touch are held, and the hold is handed to the KV role,
        which alone releases it (the core never releases a hold on a role's behalf).
        """
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.grammars.discard(request_id)
        if error is not None:
            req.error = error
            logger.warning("request %s failed: %s", request_id, error)
        if req.status == RequestStatus.WAITING_FOR_STORE:  # the load may still write
            self.store.abandon_load(request_id)
        hold_key = self.scheduler.finish(req, status)
        if self.kv_role is not None:
            self.kv_role.on_abort(self, req, hold_key)
        elif hold_key is not None:  # unreachable without a role: nothing transfers
            raise AssertionError(f"request {request_id} held blocks on a node without a role")
        if req.kv_export:
            return None  # a prefill order: its own node's clients never see it
        return self.make_output(req, [])

    @property
    def has_unfinished(self) -> bool:
        return (
            self.scheduler.has_unfinished
            or bool(self.grammars)
            or (self.kv_role is not None and self.kv_role.has_pending())
            or (self.store is not None and self.store.has_pending())
        )

    # -- the loop --------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        """One iteration: role polling, schedule, execute, update. Never waits for work."""
        role = self.kv_role
        self.num_steps += 1
        outs = role.before_step(self) if role is not None else []
        if self.grammars:  # compiles finished (or past their deadline) since the last step
            ready, failed = self.grammars.settle()
            for req in ready:
                self.scheduler.add_request(req)
            ends = [self.end_request(r, RequestStatus.FINISHED_ERROR, e) for r, e in failed]
            outs += [o for o in ends if o is not None]
        if self.store is not None:
            self.store.apply_events()
        sched = self.scheduler.schedule()
        now = time.monotonic()
        for s in sched.scheduled:
            if s.request.first_scheduled_time is None:
                s.request.first_scheduled_time = now
        for req, hold_key in sched.dropped_exports:
            self.requests.pop(req.request_id, None)
            if role is not None:
                role.on_abort(self, req, hold_key)
        if self.store is not None:
            self.store.start_loads(sched)
        if role is not None:
            role.after_schedule(self, sched)
        finished: list[Request] = []
        if sched.scheduled:
            block_ids = {
                s.request.request_id: self.kv.get_block_ids(s.request.request_id)
                for s in sched.scheduled
            }
            sampled, failed = self.runner.execute(sched, block_ids)
            if self.store is not None:
                self.store.save_prompts(sched)
            finished = self.scheduler.update_from_output(sched, sampled)
            for rid, x in sampled.items():
                req = self.requests[rid]
                if req.kv_export:
                    continue  # a prefill order: its token goes to the decode node, not here
                self.generated_tokens += 1
                outs.append(
                    self.make_output(
                        req,
                        [x.token],
                        None if x.logprob is None else [x.logprob],
                        None if x.top is None else [x.top],
                    )
                )
            for rid, error in failed.items():  # confined to these requests
                if isinstance(error, Unsatisfiable):  # its own constraints: it ends "stop"
                    logger.info("request %s stops: %s", rid, error)
                    out = self.end_request(rid, RequestStatus.FINISHED_STOPPED)
                else:
                    out = self.end_request(rid, RequestStatus.FINISHED_ERROR, error)
                if out is not None:
                    outs.append(out)
        if role is not None:
            outs.extend(role.after_step(self, sched, finished))
        for req in finished:
            self.requests.pop(req.request_id, None)
        self.last_step_idle = not sched.scheduled and not outs
        return outs

    def make_output(
        self,
        req: Request,
        tokens: list[int],
        logprobs: list[float] | None = None,
        top: list[TokenLogprobs] | None = None,
    ) -> EngineCoreOutput:
        timings = None
        if tokens and not req.timings_sent:  # the first token: report where its time went
            timings, req.timings_sent = self.first_token_timings(req), True
            paths = self.prefill_paths
            paths[timings.prefill] = paths.get(timings.prefill, 0) + 1
        prompt_lps = None
        if req.sampling_params.prompt_logprobs is not None and not req.prompt_logprobs_sent:
            if tokens or req.is_finished:
                prompt_lps, req.prompt_logprobs_sent = req.prompt_logprobs, True
        return EngineCoreOutput(
            request_id=req.request_id,
            new_token_ids=tokens,
            new_logprobs=logprobs,
            new_top_logprobs=top,
            prompt_logprobs=prompt_lps,
            finish_reason=req.status.value if req.is_finished else None,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
            error=req.error,
            timings=timings,
        )

    @property
    def kv_cache(self):
        """The model's KV cache tensors (`EngineHandle`: what a role's connector registers)."""
        return self.runner.kv_cache

    @property
    def kv_ranks(self):
        """A tensor-parallel CPU node's every rank's KV cache (`KVRanks`); None for one device."""
        return getattr(self.runner, "kv_ranks", None)

    def wait_step_done(self) -> None:
        """Block until the last step's kernels finished writing the KV cache."""
        self.runner.wait_step_done()

    @staticmethod
    def first_token_timings(req: Request) -> RequestTimings:
        """The TTFT stages of `req`, whose first token is going out now."""
        now = time.monotonic()
        t = RequestTimings(prefill=req.prefill_path)
        start = req.arrival_time
        if req.kv_order_time is not None:
            t.decode_admission_s = req.kv_order_time - req.arrival_time
            start = req.kv_order_time
            if req.kv_done_time is not None:  # the prefill node computed the prompt
                queue, compute = req.prefill_node_s or (0.0, 0.0)
                t.prefill_queue_s, t.prefill_compute_s = queue, compute
                t.kv_transfer_s = req.kv_done_time - req.kv_order_time - queue - compute
                t.first_decode_step_s = now - req.kv_done_time
                return t
        scheduled = req.first_scheduled_time if req.first_scheduled_time is not None else now
        t.queue_s, t.prefill_s = scheduled - start, now - scheduled
        return t

    # -- introspection ---------------------------------------------------------------
    def stats(self) -> EngineStats:
        pool = self.kv.pool
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=pool.num_used_blocks,
            kv_blocks_total=pool.num_blocks,
            kv_blocks_cached=pool.num_cached_blocks,
            prefix_query_tokens=self.kv.prefix_queries,
            prefix_hit_tokens=self.kv.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
            generated_tokens=self.generated_tokens,
            engine_steps=self.num_steps,
            num_waiting_for_kv=len(self.scheduler.remote_waiting),
            kv_blocks_held=self.kv.num_held_blocks,
            kv_store_hit_tokens=self.scheduler.store_hit_tokens,
            grammars_compiling=len(self.grammars),
            prefill_paths=dict(self.prefill_paths),
            **(self.kv_role.stats() if self.kv_role is not None else {}),
            **(self.kv_store.stats() if self.kv_store is not None else {}),
        )

    def check_integrity(self) -> None:
        """Pool and hold invariants (every hold claimed by a live transfer of the role)."""
        role = self.kv_role
        self.kv.check_integrity(role.claimed_holds() if role is not None else ())
        if role is not None:
            role.check_integrity()
