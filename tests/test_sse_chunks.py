"""A streamed text chunk built from its parts (`TextChunk`) is byte for byte the pydantic
model's JSON, for completions and chat, whatever the text, ids and finish reason."""

from __future__ import annotations

import json

import pytest

from pdserve.api.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
)
from pdserve.node.openai_responses import TextChunk

TEXTS = [
    "",
    " the",
    'quote " and backslash \\ and slash /',
    "new\nline\ttab\rcr\bbs\fff",
    "".join(chr(i) for i in range(32)) + "\x7f",
    "café, naïve, 日本語, emoji 😀, \u2028\u2029, \ufffd, \ue000",
    "<script>&amp;</script>",
]


def _reference(chat: bool, rid: str, model: str, index: int, text: str, finish, created: int):
    if chat:
        choice = ChatChunkChoice(
            index=index, delta=DeltaMessage(content=text), finish_reason=finish
        )
        body = ChatCompletionChunk(id=rid, model=model, created=created, choices=[choice])
    else:
        choice = CompletionChoice(index=index, text=text, finish_reason=finish)
        body = CompletionResponse(id=rid, model=model, created=created, choices=[choice])
    return body.model_dump_json()


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("finish", [None, "stop", "length", "abort"])
@pytest.mark.parametrize("rid, model, index", [
    ("cmpl-0123abcd-0", "smollm2-135m-instruct", 0),
    ('chatcmpl-"odd"\\id-3', "/models/dir with spaces/ünï", 3),
])  # fmt: skip
def test_text_chunk_equals_the_model_dump(chat, finish, rid, model, index):
    fmt = TextChunk(chat, rid, model, index)
    for text in TEXTS:
        got = fmt(text, finish)
        created = json.loads(got)["created"]
        assert isinstance(created, int)
        assert got == _reference(chat, rid, model, index, text, finish, created)
