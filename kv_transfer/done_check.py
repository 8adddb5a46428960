"""Validation of every field a prefill node returns in its `PrefillDone`.

The decode node trusts nothing a peer sends: the first token must lie in the model's
vocabulary (a peer's `first_token = 2**40` once reached `embed_tokens` and crashed the
engine), its logprob must be a finite log-probability, and the first token's top
logprobs and the prompt logprobs must be exactly what its own order asked for (counts,
the tokens they describe, ids in the vocabulary, finite log-probabilities), and so must
the block checksums (one unsigned 64-bit value per written block when asked, none
otherwise; whether they match what landed is `DecodeSide`'s check); else the
attempt fails like an incomplete transfer and the request fails over. This also bounds
what reaches a client: at most one entry per prompt token, each with at most
`MAX_LOGPROBS` + 1 tokens.
"""

from __future__ import annotations

import math

from pdserve.common.sampling_rules import MAX_LOGPROBS
from pdserve.engine.outputs import TokenLogprobs
from pdserve.kv_transfer.messages import PrefillDone, PrefillOrder


def done_problem(order: PrefillOrder, done: PrefillDone, vocab_size: int | None) -> str | None:
    """Why `done` does not answer `order` (None if it does). `vocab_size`: the model's
    (None: unknown, then ids are checked against the wire's int32 range only)."""
    vocab = vocab_size or 2**31
    if not 0 <= done.first_token < vocab:
        return f"first token {done.first_token} outside the vocabulary [0, {vocab})"
    if done.logprob is not None and not _is_logprob(done.logprob):
        return f"first token's logprob {done.logprob} is not a log-probability"
    sums = done.checksums
    if not order.checksums:
        if sums is not None:
            return "block checksums returned but not asked for"
    elif sums is None or len(sums) != done.num_blocks:
        got = "no" if sums is None else len(sums)
        return f"{got} block checksums for {done.num_blocks} blocks"
    elif any(not 0 <= x < 2**64 for x in sums):
        return "a block checksum outside the unsigned 64-bit range"
    params = order.params
    k = params.top_logprobs if params.logprobs else 0
    if not k and done.top is not None:
        return "top logprobs returned but not asked for"
    if k:
        if done.top is None:
            return f"top_logprobs={k} asked, none returned"
        problem = _entry_problem(done.top, done.first_token, k, vocab)
        if problem is not None:
            return f"first token's top logprobs: {problem}"
        if done.logprob is not None and done.logprob != done.top.logprobs[0]:
            return "first token's logprob differs from its top-logprobs entry"
    plp = done.prompt_logprobs
    if params.prompt_logprobs is None:
        return None if plp is None else "prompt logprobs returned but not asked for"
    prompt = order.prompt_token_ids
    if plp is None or len(plp) != len(prompt) - 1:
        got = "none" if plp is None else len(plp)
        return f"{got} prompt logprobs for a {len(prompt)}-token prompt"
    for j, entry in enumerate(plp):
        problem = _entry_problem(entry, prompt[j + 1], params.prompt_logprobs, vocab)
        if problem is not None:
            return f"prompt logprobs at position {j + 1}: {problem}"
    return None


def _is_logprob(x: float) -> bool:
    return math.isfinite(x) and (x <= 0.0 or math.isclose(x, 0.0, abs_tol=1e-3))


def _entry_problem(entry: TokenLogprobs, token: int, k: int, vocab: int) -> str | None:
    if not 0 <= k <= MAX_LOGPROBS:
        return f"{k} alternatives asked (at most {MAX_LOGPROBS})"
    if len(entry.token_ids) != k + 1 or len(entry.logprobs) != k + 1:
        return f"{len(entry.token_ids)} ids, {len(entry.logprobs)} logprobs, {k + 1} expected"
    if entry.token_ids[0] != token:
        return f"describes token {entry.token_ids[0]}, not {token}"
    if any(not 0 <= t < vocab for t in entry.token_ids):
        return "a token id outside the vocabulary"
    if not all(map(_is_logprob, entry.logprobs)):
        return "a logprob that is not a log-probability"
    return None
