"""The two generation endpoints: /v1/completions and /v1/chat/completions.

Each turns an OpenAI request into one engine sequence per choice (a completions batch of
prompts times `n`), checks it against the model (context length, vocabulary) before
anything is sent to the engine, then either streams SSE chunks (`data: {...}` ...
`data: [DONE]`) or collects one JSON response. Streamed and collected text come from the
same incremental detokenizer, so they are equal.

`n` > 1: the n sequences of a prompt are submitted together with the same prompt, so all
but the first find its full blocks in the prefix cache (even within one step: the cache
is written before attention reads it) and compute only the last partial block. With a
`seed`, choice i samples with seed + i.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

import msgspec

from pdserve.api.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.common.errors import InvalidRequestError
from pdserve.common.off_loop import off_loop, text_size
from pdserve.common.request_cost import CostLimits, meter_for
from pdserve.common.sampling_rules import INT64_MIN, check_token_ids
from pdserve.config.limits import RequestCostSettings
from pdserve.engine.async_llm import AsyncLLM
from pdserve.engine.config import KVTransferConfig
from pdserve.engine.outputs import RequestDelta, RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tokenizer import apply_chat_template
from pdserve.node import structured_output as structured
from pdserve.node.grammar_plans import GrammarPlans
from pdserve.node.logprobs_format import LogprobsFormatter
from pdserve.node.metrics import NodeMetrics
from pdserve.node.prefill_nodes import PrefillNodes
from pdserve.node.resume import resume_choices

logger = logging.getLogger(__name__)


class ModelNotFoundError(LookupError):
    def __init__(self, model: str):
        super().__init__(f"the model {model!r} does not exist on this node")
        self.model = model


@dataclass
class Choice:
    """One engine sequence: a prompt and the parameters of one of its `n` samples."""

    index: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt_text: str | None = None  # completions with echo: the prompt as sent
    slot: int = 0  # position in `Prepared.choices` (== index unless resumed)
    resumed: list[int] = field(default_factory=list)  # a migration's tokens already sent
    text_chars: int = 0  # ... and the characters of text the client has of them


@dataclass
class Prepared:
    request_id: str
    choices: list[Choice]
    arrival: float
    remote_prefill: str | None = None  # PD: the prefill node's control address
    echo: bool = False
    drop_output: bool = False  # max_tokens=0 with echo: the prompt alone
    logprobs: bool = False
    plan: structured.Plan = field(default_factory=structured.Plan)
    resumed: bool = False  # a migration's continuation (node/resume.py)
    drain: object | None = None  # the node's DrainMiddleware (`.draining`), if it has one
    emit_ids: bool = False  # each event carries its token ids for the router (node/resume.py)


class OpenAIServing:
    def __init__(
        self,
        llm: AsyncLLM,
        metrics: NodeMetrics,
        model_name: str,
        pd: KVTransferConfig | None = None,
        prefill_nodes: PrefillNodes | None = None,
        limits: CostLimits | None = None,
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
        self.plans = GrammarPlans()  # schema -> grammar, off the event loop, cached
        self.limits = limits or RequestCostSettings().cost_limits

    def server_timings(self, g: RequestOutput) -> dict | None:
        """`pdserve_timings` (docs/benchmarks-history.md, "Server timings"): where this request's
        first-token time went on this node: the engine's stages (`RequestTimings`) plus
        `frontend`, the rest of this node's TTFT (tokenizing, the hops to and from the
        engine process, detokenizing), and `prefill`: where the prompt was prefilled and
        why (`engine.outputs.PREFILL_PATHS`)."""
        if g.timings is None or g.ttft_s is None:
            return None
        stages = g.timings.stages()
        stages = {"frontend": g.ttft_s - sum(stages.values()), **stages}
        return {"node": self.pd.node_id, "role": self.pd.role, "ttft_s": g.ttft_s,
                "prefill": g.timings.prefill, "stages": stages}  # fmt: skip

    @property
    def fmt(self) -> LogprobsFormatter:
        return LogprobsFormatter(self.llm.tokenizer)

    # -- request preparation ------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ModelNotFoundError(model)

    def encode(self, prompt: str | list[int], add_special_tokens: bool = False) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        if self.llm.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: send token ids", "prompt")
        return self.llm.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool = True, **kw) -> list[int]:
        if self.llm.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: chat needs one", "messages")
        try:
            return apply_chat_template(
                self.llm.tokenizer, messages, add_generation_prompt=add_generation_prompt, **kw
            )
        except Exception as e:  # the template itself may reject a conversation
            raise InvalidRequestError(
                f"the chat template rejected the messages: {e}", "messages"
            ) from e

    async def prompt_ids(self, req: CompletionRequest) -> list[list[int]]:
        """Each prompt's token ids, charged to the request's cost limits prompt by prompt
        (a prompt is tokenized only while the request still fits; large text off the
        event loop)."""
        prompts = req.prompts()
        meter = meter_for(req, self.limits, len(prompts))
        out = []
        for p in prompts:
            ids = p if isinstance(p, list) else await off_loop(len(p), self.encode, p)
            meter.add_prompt(len(ids))
            out.append(ids)
        return out

    async def prepare_completion(
        self, req: CompletionRequest, trace: str | None = None, plan: structured.Plan | None = None
    ) -> Prepared:
        """`trace`: the caller's request id (a router's X-Request-Id), kept in ours.
        `plan`: the structured-output plan, if already built (`GrammarPlans`)."""
        arrival = time.monotonic()
        self.check_model(req.model)
        prompts = req.prompts()
        ids = await self.prompt_ids(req)
        max_tokens = req.max_tokens or None  # 0 (echo only) is checked as 1
        plan = plan or structured.plan(req)
        p = self._prepare("cmpl", ids, req, max_tokens, arrival, plan, trace)
        # a continuation's client has the echo: its text offsets go on after it
        p.echo, p.drop_output = req.echo and not p.resumed, req.max_tokens == 0
        p.logprobs = req.logprobs is not None
        if req.echo:
            texts = [
                q if isinstance(q, str) else await off_loop(len(q), self._decode, q)
                for q in prompts
            ]
            for c in p.choices:
                c.prompt_text = texts[c.index // req.n]
        return p

    async def prepare_chat(
        self,
        req: ChatCompletionRequest,
        trace: str | None = None,
        plan: structured.Plan | None = None,
    ) -> Prepared:
        arrival = time.monotonic()
        self.check_model(req.model)
        meter = meter_for(req, self.limits)
        plan = plan or structured.plan(req)
        if req.prompt_token_ids is not None:
            ids = req.prompt_token_ids
        elif not req.messages:
            raise InvalidRequestError("messages must not be empty", "messages")
        else:
            messages, extra = structured.template_tools(req, self.llm.tokenizer)
            ids = await off_loop(text_size(messages), lambda: self.chat_ids(messages, **extra))
        meter.add_prompt(len(ids))
        p = self._prepare("chatcmpl", [ids], req, req.requested_max_tokens, arrival, plan, trace)
        p.logprobs = req.logprobs
        return p

    def _prepare(
        self,
        kind: str,
        prompts: list[list[int]],
        req,
        max_tokens: int | None,
        arrival: float,
        plan: structured.Plan,
        trace: str | None = None,
    ) -> Prepared:
        for ids in prompts:
            self.llm.validate_prompt(ids, max_tokens)
        kwargs = req.sampling_kwargs(
            default_max_tokens=self.llm.max_model_len - max(map(len, prompts))
        )
        params = SamplingParams(**kwargs, grammar=plan.grammar)
        self._check_token_ids(params)
        # unique even if a caller reuses its id: the trace id is for logs, not for keys
        rid = f"{kind}-{trace}-{uuid.uuid4().hex[:8]}" if trace else f"{kind}-{uuid.uuid4().hex}"
        prefill_node = self._prefill_node(req)
        choices = []
        for pi, ids in enumerate(prompts):
            for i in range(req.n):
                index = pi * req.n + i
                choices.append(Choice(index, f"{rid}-{index}", ids, _nth(params, i), slot=index))
        logger.info(
            "request %s: %d choice(s), %s prompt tokens, max_tokens=%d, temperature=%s, "
            "stream=%s%s",
            rid,
            len(choices),
            "/".join(str(len(x)) for x in prompts),
            params.max_tokens,
            params.temperature,
            req.stream,
            f", prefill on {prefill_node}" if prefill_node else "",
        )
        p = Prepared(rid, choices, arrival, prefill_node, plan=plan)
        resume = req.kv_transfer_params.resume if req.kv_transfer_params else None
        if resume:
            resume_choices(p, resume, self.llm.validate_prompt)
        return p

    def _check_token_ids(self, params: SamplingParams) -> None:
        vocab = self.llm.info.vocab_size if self.llm.info else None
        check_token_ids(params.stop_token_ids, vocab, "stop_token_ids")
        check_token_ids(params.logit_bias, vocab, "logit_bias")

    def _prefill_node(self, req) -> str | None:
        """The prefill node for a PD request: the router's choice if allowed, else in turn."""
        asked = req.kv_transfer_params.prefill_node if req.kv_transfer_params else None
        return self.prefill_nodes.choose(asked)

    def _decode(self, ids: list[int]) -> str:
        tok = self.llm.tokenizer
        return tok.decode(ids) if tok is not None else ""

    # -- generation ---------------------------------------------------------------------
    async def _deltas(self, p: Prepared, c: Choice) -> AsyncIterator[tuple[Choice, RequestDelta]]:
        """One choice's deltas, with metrics observed along the way."""
        async with aclosing(
            self.llm.generate(
                c.request_id,
                c.prompt_token_ids,
                c.params,
                p.arrival,
                p.remote_prefill,
                (c.resumed, c.text_chars) if c.resumed else None,
            )  # fmt: skip
        ) as gen:
            async for delta in gen:
                self.metrics.observe_tokens(delta.ttft_s, delta.itl_s)
                if delta.finish_reason is not None:
                    self.metrics.observe_finished(
                        delta.finish_reason,
                        len(c.prompt_token_ids),
                        time.monotonic() - p.arrival,
                    )
                    logger.info(
                        "request %s finished (%s): %d tokens",
                        c.request_id,
                        delta.finish_reason,
                        delta.num_output_tokens,
                    )
                yield c, delta

    def deltas(self, p: Prepared) -> AsyncGenerator[tuple[Choice, RequestDelta], None]:
        """Every choice's deltas, interleaved as they arrive. Leaving early (or one choice
        failing) aborts every choice still running. One choice: its own generator, with
        no layer between (a hop through an async generator per token costs)."""
        if len(p.choices) == 1:
            return self._deltas(p, p.choices[0])
        return self._interleaved(p)

    async def _interleaved(self, p: Prepared) -> AsyncIterator[tuple[Choice, RequestDelta]]:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(c: Choice) -> None:
            try:
                async with aclosing(self._deltas(p, c)) as gen:
                    async for _, delta in gen:
                        queue.put_nowait((c, delta, None))
            except Exception as e:  # noqa: BLE001 - handed to the consumer
                queue.put_nowait((c, None, e))
            else:
                queue.put_nowait((c, None, None))

        tasks = [asyncio.create_task(pump(c)) for c in p.choices]
        try:
            running = len(tasks)
            while running:
                c, delta, error = await queue.get()
                if delta is None:
                    running -= 1
                    if error is not None:
                        raise error
                    continue
                yield c, delta
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def collect(self, p: Prepared) -> list[RequestOutput]:
        gens = [RequestOutput() for _ in p.choices]
        async with aclosing(self.deltas(p)) as deltas:
            async for c, delta in deltas:
                gens[c.slot].add(delta)
        return gens


def _nth(params: SamplingParams, i: int) -> SamplingParams:
    """Choice i of n: seed + i (wrapped into int64), so the n samples differ."""
    if i == 0 or params.seed is None:
        return params
    seed = (params.seed + i - INT64_MIN) % 2**64 + INT64_MIN
    return msgspec.structs.replace(params, seed=seed)
