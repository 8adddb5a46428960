"""Response bodies and SSE streams of the generation endpoints, from prepared requests
(`pdserve.node.openai_serving.Prepared`) and what their choices produced."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from pdserve.api.chat_tools import strip_tool_calls
from pdserve.api.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
    PromptTokensDetails,
    UsageInfo,
)
from pdserve.api.structured import DeltaToolCall
from pdserve.engine.async_llm import RequestFailedError
from pdserve.engine.core_client import EngineDeadError
from pdserve.engine.outputs import RequestDelta, RequestOutput, TokenLogprobs
from pdserve.node import structured_output as structured
from pdserve.node.openai_serving import Choice, OpenAIServing, Prepared
from pdserve.node.resume import ids_comment, kv_comment, resumed_text

logger = logging.getLogger(__name__)


# A JSON string as pydantic's serializer writes it (non-ASCII raw, the same escapes): what
# `json.dumps(s, ensure_ascii=False)` returns for a str, without its Python wrapper.
_js = json.encoder.encode_basestring


class TextChunk:
    """The JSON of one choice's stream chunk that carries text only (no logprobs, no tool
    calls): `CompletionResponse` / `ChatCompletionChunk` with one choice, as
    `model_dump_json()` writes it, byte for byte (tests/test_sse_chunks.py), from parts
    built once per choice. One such chunk goes out per token of every stream: building the
    pydantic models and dumping them was the largest part of its cost in this process."""

    def __init__(self, chat: bool, request_id: str, model: str, index: int):
        obj = "chat.completion.chunk" if chat else "text_completion"
        self.head = f'{{"id":{_js(request_id)},"object":"{obj}","created":'
        choice = f'"choices":[{{"index":{index},'
        if chat:
            self.mid = f',"model":{_js(model)},{choice}"delta":{{"role":null,"content":'
            self.tail = ',"tool_calls":null},"logprobs":null,"finish_reason":'
        else:
            self.mid = f',"model":{_js(model)},{choice}"text":'
            self.tail = ',"logprobs":null,"finish_reason":'

    def __call__(self, text: str, finish_reason: str | None) -> str:
        finish = "null" if finish_reason is None else _js(finish_reason)
        return (
            f"{self.head}{int(time.time())}{self.mid}{_js(text)}{self.tail}{finish}"
            '}],"usage":null}'
        )


def usage(p: Prepared, gens: list[RequestOutput]) -> UsageInfo:
    """Each distinct prompt counts once; every choice's output counts."""
    seen: set[int] = set()
    prompt = cached = completion = 0
    for c, g in zip(p.choices, gens):
        completion += 0 if p.drop_output else len(g.token_ids)
        if id(c.prompt_token_ids) not in seen:
            seen.add(id(c.prompt_token_ids))
            prompt += len(c.prompt_token_ids)
            cached += g.num_cached_tokens
    return UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def _tops(ids: list[int], lps: list[float], top: list[TokenLogprobs] | None):
    if top is not None:
        return list(top)
    return [TokenLogprobs([t], [lp]) for t, lp in zip(ids, lps)]


def completion_piece(
    s: OpenAIServing,
    p: Prepared,
    c: Choice,
    g: RequestOutput | RequestDelta,
    first: bool,
    offset: int,
) -> tuple[str, CompletionLogprobs | None]:
    """Text and logprobs of a generation (or of one delta of it, as a RequestOutput): the
    echoed prompt first when `first`, then the tokens unless `drop_output`."""
    text, ids, lps, tops = "", [], [], []
    if first and p.echo:
        text = c.prompt_text or ""
        if p.logprobs:
            plp = g.prompt_logprobs or []
            ids = list(c.prompt_token_ids)
            lps = [None, *(e.logprobs[0] for e in plp)]
            tops = [None, *plp]
    if not p.drop_output:
        text += g.text
        if p.logprobs and g.logprobs is not None:
            ids += g.token_ids
            lps += g.logprobs
            tops += _tops(g.token_ids, g.logprobs, g.top_logprobs)
    if not p.logprobs:
        return text, None
    return text, s.fmt.completion(ids, lps, tops, offset)


def completion_response(
    s: OpenAIServing, p: Prepared, gens: list[RequestOutput]
) -> CompletionResponse:
    choices = []
    for c, g in zip(p.choices, gens):
        text, lp = completion_piece(s, p, c, g, True, 0)
        choices.append(
            CompletionChoice(index=c.index, text=text, logprobs=lp, finish_reason=g.finish_reason)
        )
    return CompletionResponse(
        id=p.request_id, model=s.model_name, choices=choices, usage=usage(p, gens)
    )


def chat_response(
    s: OpenAIServing, p: Prepared, gens: list[RequestOutput]
) -> ChatCompletionResponse:
    choices = []
    for c, g in zip(p.choices, gens):
        lp = None
        if g.logprobs is not None:
            lp = s.fmt.chat(g.token_ids, g.logprobs, g.top_logprobs)
        calls = structured.tool_calls(p.plan, g.text)
        content: str | None = g.text
        if calls and p.plan.tools_forced:
            content = None
        elif calls:
            content = strip_tool_calls(g.text) or None
        choices.append(
            ChatChoice(
                index=c.index,
                message=AssistantMessage(content=content, tool_calls=calls),
                logprobs=lp,
                finish_reason="tool_calls" if calls else g.finish_reason,
            )
        )
    return ChatCompletionResponse(
        id=p.request_id, model=s.model_name, choices=choices, usage=usage(p, gens)
    )


async def stream_completion(
    s: OpenAIServing, p: Prepared, include_usage: bool
) -> AsyncIterator[str]:
    # a resumed choice's text goes on (after the prompt, echoed to its client at first)
    offsets = [c.text_chars + len(c.prompt_text or "") * p.resumed for c in p.choices]
    started = [False] * len(p.choices)
    plain = [TextChunk(False, p.request_id, s.model_name, c.index) for c in p.choices]

    def chunk(c: Choice, g: RequestOutput | RequestDelta) -> str | None:
        text, lp = completion_piece(s, p, c, g, not started[c.slot], offsets[c.slot])
        started[c.slot] = True
        offsets[c.slot] += len(text)
        if not text and g.finish_reason is None and not (lp and lp.tokens):
            return None
        if lp is None:
            return plain[c.slot](text, g.finish_reason)
        return CompletionResponse(
            id=p.request_id,
            model=s.model_name,
            choices=[
                CompletionChoice(
                    index=c.index, text=text, logprobs=lp, finish_reason=g.finish_reason
                )
            ],
        ).model_dump_json()

    def usage_chunk(gens: list[RequestOutput]) -> str:
        return CompletionResponse(
            id=p.request_id, model=s.model_name, choices=[], usage=usage(p, gens)
        ).model_dump_json()

    async for event in _sse(s, p, include_usage, chunk, usage_chunk, first=[]):
        yield event


async def stream_chat(s: OpenAIServing, p: Prepared, include_usage: bool) -> AsyncIterator[str]:
    """With tools, a choice's tool calls come in one delta with its finish; a forced tool
    call streams no content (its JSON is the call). A migrated choice's calls are parsed
    from its whole reply: the text its client has, then this node's."""
    tooling = p.plan.tools_forced or p.plan.tools_auto
    texts = [resumed_text(s.llm.tokenizer, c) if tooling else "" for c in p.choices]
    plain = [TextChunk(True, p.request_id, s.model_name, c.index) for c in p.choices]

    def chunk(c: Choice, g: RequestOutput | RequestDelta) -> str | None:
        text = "" if p.plan.tools_forced else g.text
        finish = g.finish_reason
        calls = None
        if tooling:
            texts[c.slot] += g.text
            if finish is not None:
                calls = structured.tool_calls(p.plan, texts[c.slot]) or None
                if calls:
                    finish = "tool_calls"
        if not text and finish is None and not g.logprobs:
            return None
        if g.logprobs is None and calls is None:
            return plain[c.slot](text, finish)
        delta = DeltaMessage(content=text)
        if calls:
            delta.tool_calls = [
                DeltaToolCall(index=i, id=call.id, function=call.function)
                for i, call in enumerate(calls)
            ]
        lp = None
        if g.logprobs is not None:
            lp = s.fmt.chat(g.token_ids, g.logprobs, g.top_logprobs)
        return ChatCompletionChunk(
            id=p.request_id,
            model=s.model_name,
            choices=[
                ChatChunkChoice(index=c.index, delta=delta, logprobs=lp, finish_reason=finish)
            ],
        ).model_dump_json()

    def usage_chunk(gens: list[RequestOutput]) -> str:
        return ChatCompletionChunk(
            id=p.request_id, model=s.model_name, choices=[], usage=usage(p, gens)
        ).model_dump_json()

    first = [
        ChatCompletionChunk(
            id=p.request_id,
            model=s.model_name,
            choices=[
                ChatChunkChoice(index=c.index, delta=DeltaMessage(role="assistant", content=""))
            ],
        ).model_dump_json()
        for c in p.choices
        if not p.resumed  # a continuation's client has its role chunks
    ]
    async for event in _sse(s, p, include_usage, chunk, usage_chunk, first=first):
        yield event


class HandedOff(Exception):
    """A draining node ends a router's stream, which the router moves to another node."""


def with_timings(body_json: str, timings: dict | None) -> str:
    """A chunk's JSON with `pdserve_timings` added (unchanged without timings)."""
    if timings is None:
        return body_json
    body = json.loads(body_json)
    body["pdserve_timings"] = timings
    return json.dumps(body, separators=(",", ":"))


async def _sse(s: OpenAIServing, p: Prepared, include_usage: bool, chunk, usage_chunk, first):
    for f in first:
        yield f"data: {f}\n\n"
    gens = [RequestOutput() for _ in p.choices]
    chars = [c.text_chars for c in p.choices]  # output text sent, per choice
    running = len(p.choices)
    try:
        async with aclosing(s.deltas(p)) as deltas:
            async for c, delta in deltas:
                gens[c.slot].add(delta)
                body = chunk(c, delta)  # reads the fields a RequestOutput of it would have
                if body is not None and delta.finish_reason is not None:
                    body = with_timings(body, s.server_timings(gens[c.slot]))
                event = "" if body is None else f"data: {body}\n\n"
                if p.emit_ids and (delta.token_ids or delta.finish_reason):
                    chars[c.slot] += len(delta.text)
                    finished = delta.finish_reason is not None
                    comment = ids_comment(c.index, chars[c.slot], finished, delta.token_ids)
                    if delta.timings is not None and delta.timings.prefill:
                        comment += kv_comment(delta.timings.prefill, delta.num_cached_tokens)
                    event = comment + (event or "\n")
                running -= delta.finish_reason is not None
                if event:
                    yield event
                if running and p.emit_ids and p.drain is not None and p.drain.draining:
                    raise HandedOff
    except HandedOff:  # the router migrates it (router/migration.py)
        logger.info("request %s: handed back to the router (draining)", p.request_id)
        err = ErrorResponse(error=ErrorInfo(message="this node is draining", type="server_error",
                                            code="draining"))  # fmt: skip
        yield f"data: {err.model_dump_json()}\n\n"
    except (RequestFailedError, EngineDeadError) as e:  # a stream ends with an error event
        logger.error("request %s failed: %s", p.request_id, e)
        code = "engine_dead" if s.llm.client.dead is not None else "engine_error"
        err = ErrorResponse(error=ErrorInfo(message=str(e), type="server_error", code=code))
        yield f"data: {err.model_dump_json()}\n\n"
    else:
        if include_usage:
            yield f"data: {usage_chunk(gens)}\n\n"
    yield "data: [DONE]\n\n"
