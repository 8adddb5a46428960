"""A migrated request's continuation, on the node that takes it over (the router's side is
router/migration.py).

The router sends the request again with `kv_transfer_params.resume`: for each choice still
running, the tokens it already streamed and how many characters of text the client has.
Each such choice becomes one engine sequence whose prompt is the original prompt plus
those tokens, so its KV comes the way any prompt's does (this node's prefix cache, the
KV store, a prefill node); `max_tokens` and `min_tokens` shrink by what was generated,
and `SamplingParams.resumed_tokens` tells the engine that the prompt's tail is output
(penalties count it, a grammar replays it). The seed stays the choice's own (seed + i):
the engine seeds each draw from (seed, position), so the sampled tokens continue the run
exactly. Choices that had finished are not sent again.

With `X-Pdserve-Token-Ids: 1` (the router sets it) each streamed event starts with an SSE
comment line the router strips: `: ids <index> <chars> <finished> <id> <id> ...`, the
choice's cumulative text characters after this event, 1 if the event ends the choice,
and the token ids it carries (`ids_comment`).
"""

from __future__ import annotations

import msgspec

from pdserve.api.protocol import ResumeChoice
from pdserve.common.errors import InvalidRequestError
from pdserve.engine.detokenizer import IncrementalDetokenizer

TOKEN_IDS_HEADER = "x-pdserve-token-ids"


def resume_choices(p, resume: list[ResumeChoice], validate) -> None:
    """Keep only `p`'s resumed choices, each extended by its generated tokens.
    `validate(ids, max_tokens)` is the node's prompt check (context length, vocabulary)."""
    by_index = {c.index: c for c in p.choices}
    kept = []
    for slot, r in enumerate(resume):
        c = by_index.get(r.index)
        if c is None or any(k.index == r.index for k in kept):
            raise InvalidRequestError(
                f"resume names choice {r.index} twice or out of range", "kv_transfer_params"
            )
        k = len(r.token_ids)
        if k and c.params.max_tokens <= k:
            raise InvalidRequestError(
                "resume has as many tokens as max_tokens allows", "kv_transfer_params"
            )
        c.prompt_token_ids = c.prompt_token_ids + r.token_ids
        validate(c.prompt_token_ids, c.params.max_tokens - k)
        c.params = msgspec.structs.replace(
            c.params,
            max_tokens=c.params.max_tokens - k,
            min_tokens=max(0, c.params.min_tokens - k),
            prompt_logprobs=None,
            resumed_tokens=k,
        )
        c.slot, c.resumed, c.text_chars = slot, list(r.token_ids), r.text_chars
        kept.append(c)
    p.choices = kept
    p.resumed = True


def ids_comment(index: int, chars: int, finished: bool, ids: list[int]) -> str:
    """The comment line that carries one event's token ids to the router."""
    return f": ids {index} {chars} {int(finished)} {' '.join(map(str, ids))}\n"


def kv_comment(prefill: str, cached_tokens: int) -> str:
    """The comment line, after a choice's first `ids` line, that tells the router where its
    prompt's KV came from: the engine's prefill path (`engine.outputs.PREFILL_PATHS`) and
    the tokens its own prefix cache held (router/migration.py names a migration's path)."""
    return f": kv {prefill} {cached_tokens}\n"


def resumed_text(tokenizer, c) -> str:
    """The text a resumed choice's client has (its tokens' text, up to its characters), as
    the engine's detokenizer continues it; "" for a choice that is not resumed."""
    if not c.resumed or tokenizer is None:
        return ""
    d = IncrementalDetokenizer(tokenizer)
    d.resume(c.resumed, c.text_chars)
    return d.output_text
