"""OpenAI API request and response models (pydantic), shared by nodes and the router.

Requests accept what OpenAI clients send; unknown fields are ignored, fields this server
cannot honour with a non-default value (n > 1, echo, penalties, top_logprobs) are rejected
with the field's name. Extensions: `top_k`, `min_p`, `ignore_eos`, and pre-tokenized input
(`prompt` as a token id list for completions, `prompt_token_ids` for chat).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from api.errors import InvalidRequestError


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class KVTransferParams(_Request):
    """Extension (PD): which prefill node computes this prompt's KV (a control address)."""

    prefill_node: str | None = None


class _SamplingRequest(_Request):
    model: str | None = None
    kv_transfer_params: KVTransferParams | None = None
    temperature: float | None = None  # None (or absent): 1.0
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    ignore_eos: bool = False
    user: str | None = None

    def _check_unsupported(self) -> None:
        if self.n != 1:
            raise InvalidRequestError("only n=1 is supported", "n")
        if self.presence_penalty or self.frequency_penalty:
            param = "presence_penalty" if self.presence_penalty else "frequency_penalty"
            raise InvalidRequestError(f"{param} is not supported", param)

    def _sampling_kwargs(self, max_tokens: int, logprobs: bool) -> dict[str, Any]:
        self._check_unsupported()
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return dict(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            max_tokens=max_tokens,
            stop=stop,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
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

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request (a list of one prompt is accepted too)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise InvalidRequestError("only one prompt per request is supported", "prompt")
            return p[0]  # type: ignore[return-value]
        return p  # type: ignore[return-value]

    def sampling_kwargs(self, default_max_tokens: int) -> dict[str, Any]:
        """Keyword arguments of the engine's `SamplingParams` for this request."""
        if self.echo:
            raise InvalidRequestError("echo is not supported", "echo")
        if self.suffix:
            raise InvalidRequestError("suffix is not supported", "suffix")
        if self.best_of not in (None, 1):
            raise InvalidRequestError("only best_of=1 is supported", "best_of")
        if self.logprobs not in (None, 0):
            raise InvalidRequestError(
                "only logprobs=0 (the sampled token's logprob) is supported", "logprobs"
            )
        max_tokens = default_max_tokens if self.max_tokens is None else self.max_tokens
        return self._sampling_kwargs(max_tokens, self.logprobs is not None)


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def to_template_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        msg = {"role": self.role, "content": content or ""}
        if self.name:
            msg["name"] = self.name
        return msg


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(default_factory=list)
    prompt_token_ids: list[int] | None = None  # extension: the router's pre-tokenized prompt
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def sampling_kwargs(self, default_max_tokens: int) -> dict[str, Any]:
        """Keyword arguments of the engine's `SamplingParams` for this request."""
        if not self.messages and self.prompt_token_ids is None:
            raise InvalidRequestError("messages must not be empty", "messages")
        if self.top_logprobs:
            raise InvalidRequestError("top_logprobs is not supported", "top_logprobs")
        max_tokens = self.max_completion_tokens
        if max_tokens is None:
            max_tokens = self.max_tokens
        if max_tokens is None:
            max_tokens = default_max_tokens
        return self._sampling_kwargs(max_tokens, self.logprobs)

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
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] | None = None
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


class ChatLogprobToken(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[dict] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobToken] = Field(default_factory=list)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


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
