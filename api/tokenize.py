"""vLLM's /tokenize and /detokenize request and response models."""

from __future__ import annotations

from pydantic import BaseModel

from pdserve.api.protocol import ChatMessage, _TopRequest


class TokenizeRequest(_TopRequest):
    """vLLM's /tokenize: a `prompt`, or chat `messages` rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_TopRequest):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
