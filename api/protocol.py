"""OpenAI API request and response models (pydantic), shared by nodes and the router.

Strict: a field this server does not know is a 400 naming it, unless it is on
`IGNORED_FIELDS` (accepted, has no effect here, logged as a warning): nothing silently
changes the meaning of a request. Extensions (as vLLM has them): `top_k`, `min_p`,
`repetition_penalty`, `min_tokens`, `stop_token_ids`, `ignore_eos`, pre-tokenized input
(`prompt` as token ids for completions, `prompt_token_ids` for chat) and
`kv_transfer_params` (PD).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pdserve.api.structured import DeltaToolCall, NamedToolChoice, ResponseFormat, ToolCall, ToolDef
from pdserve.common.errors import InvalidRequestError
from pdserve.common.sampling_rules import ascii_int

logger = logging.getLogger(__name__)

MAX_N = 16  # choices per request (each is one engine sequence)
MAX_PROMPTS = 64  # prompts per /v1/completions request
MAX_LOGPROBS = 20

# Accepted and ignored: fields that do not change what the model generates here.
IGNORED_FIELDS = {
    "user": "an end-user id for abuse monitoring",
    "store": "OpenAI-side storage of completions",
    "metadata": "OpenAI-side tags for stored completions",
    "service_tier": "OpenAI's processing tier",
    "parallel_tool_calls": "at most one tool call is generated per choice",
}


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _TopRequest(_Request):
    @model_validator(mode="before")
    @classmethod
    def _drop_ignored(cls, data: Any) -> Any:
        if isinstance(data, dict):
            ignored = [k for k in data if k in IGNORED_FIELDS]
            if ignored:
                logger.warning("accepted and ignored request fields: %s", ", ".join(ignored))
                data = {k: v for k, v in data.items() if k not in IGNORED_FIELDS}
        return data


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ResumeChoice(_Request):
    """Extension (router migration): choice `index` goes on after `token_ids`, of which a
    client has already received `text_chars` characters of text."""

    index: int = Field(ge=0)
    token_ids: list[int] = Field(default_factory=list)
    text_chars: int = Field(0, ge=0)


class KVTransferParams(_Request):
    """Extension (PD): which prefill node computes this prompt's KV (a control address);
    `resume`: the router's continuation of a migrated request (node/resume.py)."""

    prefill_node: str | None = None
    resume: list[ResumeChoice] | None = None


class _SamplingRequest(_TopRequest):
    model: str | None = None
    kv_transfer_params: KVTransferParams | None = None
    temperature: float | None = None  # None (or absent): 1.0
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    response_format: ResponseFormat | None = None
    cache_salt: str | None = None  # vLLM's: prefix-cache hits only among the same salt

    def _sampling_kwargs(self, max_tokens: int) -> dict[str, Any]:
        if not 1 <= self.n <= MAX_N:
            raise InvalidRequestError(f"n must be in [1, {MAX_N}], got {self.n}", "n")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        bias: dict[int, float] = {}
        for key, value in (self.logit_bias or {}).items():
            token = ascii_int(key)
            if token is None:
                raise InvalidRequestError(
                    f"logit_bias keys must be token ids (decimal digits), got {key[:40]!r}",
                    "logit_bias",
                )
            bias[token] = value
        return dict(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            max_tokens=max_tokens,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=bias,
            min_tokens=self.min_tokens,
            cache_salt=self.cache_salt or "",
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one, or a batch (a list of strings or of token-id lists)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) > MAX_PROMPTS:
                raise InvalidRequestError(f"at most {MAX_PROMPTS} prompts per request", "prompt")
            return list(p)  # type: ignore[arg-type]
        return [p]  # type: ignore[list-item]

    def sampling_kwargs(self, default_max_tokens: int) -> dict[str, Any]:
        """Keyword arguments of the engine's `SamplingParams` for this request.

        `max_tokens=0` (only with `echo`) asks for the prompt alone: the engine still
        samples one token, which the frontend drops."""
        if self.suffix:
            raise InvalidRequestError("suffix is not supported", "suffix")
        if self.best_of not in (None, 1, self.n):
            raise InvalidRequestError("best_of must equal n (no server-side ranking)", "best_of")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(
                f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}", "logprobs"
            )
        max_tokens = default_max_tokens if self.max_tokens is None else self.max_tokens
        if max_tokens == 0 and not self.echo:
            raise InvalidRequestError("max_tokens=0 needs echo=true", "max_tokens")
        kw = self._sampling_kwargs(1 if max_tokens == 0 else max_tokens)
        kw.update(logprobs=self.logprobs is not None, top_logprobs=self.logprobs or 0)
        if self.echo and self.logprobs is not None:
            kw["prompt_logprobs"] = self.logprobs
        return kw


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # assistant: calls it made
    tool_call_id: str | None = None  # tool: which call this answers
    refusal: str | None = None

    def to_template_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        msg: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name:
            msg["name"] = self.name
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        if self.tool_call_id:
            msg["tool_call_id"] = self.tool_call_id
        return msg


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(default_factory=list)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    prompt_token_ids: list[int] | None = None  # extension: the router's pre-tokenized prompt
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def sampling_kwargs(self, default_max_tokens: int) -> dict[str, Any]:
        """Keyword arguments of the engine's `SamplingParams` for this request."""
        if not self.messages and self.prompt_token_ids is None:
            raise InvalidRequestError("messages must not be empty", "messages")
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise InvalidRequestError(
                    f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}",
                    "top_logprobs",
                )
            if self.top_logprobs and not self.logprobs:
                raise InvalidRequestError("top_logprobs needs logprobs=true", "top_logprobs")
        max_tokens = self.requested_max_tokens
        if max_tokens is None:
            max_tokens = default_max_tokens
        kw = self._sampling_kwargs(max_tokens)
        kw.update(logprobs=self.logprobs, top_logprobs=self.top_logprobs or 0)
        return kw

    @property
    def requested_max_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )


# -- responses ------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobToken] = Field(default_factory=list)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pdserve"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
