"""CPU work a request brings (tokenizing its prompts, rendering its chat template) runs
off the event loop when it is large, so one big request never stalls the other streams
of the process; small work stays inline (a thread hop costs more than it saves)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

INLINE_CHARS = 4096  # text up to this size is tokenized on the loop


async def off_loop(size: int, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)`, on a worker thread when `size` (characters of text) is large."""
    if size <= INLINE_CHARS:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


def text_size(messages: list[dict]) -> int:
    """About how many characters of text a conversation holds (its string contents)."""
    total = 0
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            for part in content:
                text = part.get("text") if isinstance(part, dict) else None
                total += len(text) if isinstance(text, str) else 16
        total += 16
    return total
